"""One reconcile tick, and the operator commands that change what the tick converges on."""

from __future__ import annotations

import asyncio
import time

from holdfast_contract.control import (
    ControlReply,
    EvictReq,
    PromoteReq,
    RefitReq,
    Request,
    RollbackReq,
    StatusReq,
    StopReq,
    UpdateReq,
)
from supervisor import decisions
from supervisor.core import Crew
from supervisor.decisions import earliest
from supervisor.errors import ControlError
from supervisor.pace import sched_state, thread_runs
from supervisor.policy import admission_cap_mb
from supervisor.states import EngineState
from supervisor.units import Engine, Incarnation
from supervisor.update.rollout import Rollout


async def tick(c: Crew) -> float | None:
    """Converge once; returns the monotonic time something is next due, or None."""
    now = time.monotonic()
    due = c.daemons.reconcile(now)
    due = earliest(due, await _check_liveness(c, now))
    if c.primary is None:
        s = c.best_standby()
        if s is not None:
            c.promote(s, now, cause="no-primary", old=None)
    if not c.daemons.all_serving():
        return due  # engines start once every daemon serves again (its event wakes us)
    for e in list(c.engines.values()):
        if e.state == EngineState.DEAD and e.serving:
            due = earliest(due, await _restart_serving(c, e, now))
    return earliest(due, await _batch(c, now))


async def _check_liveness(c: Crew, now: float) -> float | None:
    """Fence engines that never got ready or went silent; when the next check is due. A
    overdue engine is judged by what its threads do (`pace`, `decisions.judge_silence`): a
    busy machine, or a stalled supervisor, is not a hang."""
    due: float | None = None
    c.pace.observe(now)  # a stall that ends now counts before the ticker has seen it
    for e in list(c.engines.values()):
        refused = c.refused.pop(e.name, None) if e is c.primary else None
        stalled = c.pace.stalled_s(e.last_beat, now) if e.last_beat else 0.0
        verdict = decisions.liveness(e, now, c.windows, refused, stalled)
        if isinstance(verdict, decisions.Overdue):
            c.hub.drain(c)  # a heartbeat that came but waits unread is no silence
            verdict = decisions.liveness(e, now, c.windows, None, stalled)
        if isinstance(verdict, decisions.Overdue):
            inc = e.inc  # an overdue engine has one
            sched = sched_state(p.pid for p in inc.procs) if inc is not None else "gone"
            ran = _ran(inc) if inc is not None else None
            verdict = decisions.judge_silence(verdict, sched, now, c.windows, ran)
        if isinstance(verdict, decisions.Fence):
            await c.fence(e, cause=verdict.cause, detail=verdict.detail)
        else:
            due = earliest(due, verdict)
    return due


def _ran(inc: Incarnation) -> bool | None:
    """Whether `inc`'s heartbeat thread was given a CPU since its last heartbeat came;
    None when that thread is unknown (no agent, or an agent that does not name it)."""
    now = thread_runs(*inc.beat_thread)
    return None if now is None or inc.beat_runs is None else now > inc.beat_runs


async def _restart_serving(c: Crew, e: Engine, now: float) -> float | None:
    if now < e.next_start:
        return e.next_start
    engines = list(c.engines.values())
    for victim in decisions.admission_victims(engines, e.memory_mb, admission_cap_mb(c.policy)):
        await c.evict(victim, reason="admission", held=False)
    await c.spawn(e)
    return None


async def _batch(c: Crew, now: float) -> float | None:
    load = decisions.load_of(c.primary)
    plan = c.batch.plan(list(c.engines.values()), load, now)
    c.want(plan.wants)  # published before it is carried out
    if plan.evict is not None:
        spec = c.policy.engines.load
        await c.evict(plan.evict, reason=f"load {load} > {spec.evict_above}", held=False)
    for e in plan.start:
        await c.spawn(e)
    return plan.due


async def handle(
    c: Crew, req: Request, stop: asyncio.Event, rollout: Rollout | None = None
) -> ControlReply:
    """Answer one operator request; StopReq sets `stop`; an update and a rollback go to
    `rollout` (supervisor/update/)."""
    if isinstance(req, StatusReq):
        return ControlReply(ok=True, status=c.snapshot())
    if isinstance(req, StopReq):
        stop.set()
        return ControlReply(ok=True, message="stopping")
    if isinstance(req, UpdateReq | RollbackReq | RefitReq):
        if rollout is None:
            raise ControlError("this supervisor makes no rolling updates")
        said = await (
            rollout.update(req)
            if isinstance(req, UpdateReq)
            else rollout.refit(req)
            if isinstance(req, RefitReq)
            else rollout.rollback()
        )
        return ControlReply(ok=True, message=said)
    e = c.find(req.name)
    if isinstance(req, PromoteReq):
        return await _promote(c, e)
    if isinstance(req, EvictReq):
        if e.serving:
            raise ControlError(f"{e.name} is a {e.role} engine; only batch engines are evicted")
        await c.evict(e, reason="operator", held=True)
        c.wake.set()
        return ControlReply(
            ok=True, message=f"{e.name} evicted; `supervisor restart {e.name}` brings it back"
        )
    return await _restart(c, e)


async def _promote(c: Crew, e: Engine) -> ControlReply:
    await c.hand_over(e)
    return ControlReply(ok=True, message=f"{e.name} is primary at epoch {c.epoch}")


async def _restart(c: Crew, e: Engine) -> ControlReply:
    await c.restart(e)
    return ControlReply(ok=True, message=f"{e.name} restarting")
