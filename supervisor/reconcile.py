"""One reconcile tick, and the operator commands that change what the tick converges on."""

from __future__ import annotations

import asyncio
import time

from holdfast_contract.control import (
    ControlReply,
    EvictReq,
    PromoteReq,
    RestartReq,
    StatusReq,
    StopReq,
)
from supervisor.core import Cluster
from supervisor.errors import ControlError
from supervisor.units import Engine


async def tick(c: Cluster) -> float | None:
    """Converge once; returns the monotonic time something is next due, or None."""
    now = time.monotonic()
    due = c.daemons.reconcile(now) if c.daemons is not None else None
    due = _earliest(due, await _check_liveness(c, now))
    if c.primary is None:
        s = c.best_standby()
        if s is not None:
            c.promote(s, now, cause="no-primary", old=None)
    if c.daemons is not None and not c.daemons.all_serving():
        return due  # engines start once every daemon serves again (its event wakes us)
    for e in list(c.engines.values()):
        if e.state == "dead" and e.serving:
            due = _earliest(due, await _restart_serving(c, e, now))
    due = _earliest(due, await _batch(c, now))
    return due


def _earliest(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    return a if b is None else min(a, b)


async def _check_liveness(c: Cluster, now: float) -> float | None:
    """Fence engines that never got ready or went silent; when the next check is due."""
    timeout = c.policy.engines.ready_timeout_s
    due: float | None = None
    for e in list(c.engines.values()):
        inc = e.inc
        if inc is None or inc.handled or not e.running or e.state == "draining":
            continue
        refused = c.refused.pop(e.name, None) if e is c.primary else None
        if refused is not None:
            await c.fence(e, cause="promote-refused", detail=refused)
        elif not inc.ready and now - inc.started > timeout:
            await c.fence(
                e, cause="not-ready", detail=f"not ready within engines.ready_timeout_s={timeout}"
            )
        elif inc.hello and now - e.last_beat > c.silence_s(inc.ready):
            silent = round((now - e.last_beat) * 1000, 1)
            await c.fence(e, cause="hang", detail=f"no heartbeat for {silent} ms")
        elif inc.hello:
            due = _earliest(due, e.last_beat + c.silence_s(inc.ready) + 0.001)
    return due


async def _restart_serving(c: Cluster, e: Engine, now: float) -> float | None:
    if now < e.next_start:
        return e.next_start
    if not c.fits(e.memory_mb):
        for victim in c.running_batch():
            await c.evict(victim, reason="admission", held=False)
            if c.fits(e.memory_mb):
                break
    await c.spawn(e)
    return None


async def _batch(c: Cluster, now: float) -> float | None:
    spec = c.policy.engines.load
    p = c.primary
    load = p.in_flight if p is not None else 0  # accepted and not finished: queued included
    interval = c.policy.heartbeat.interval_ms / 1000.0
    if load > spec.evict_above:
        c.low_since = None
        victims = c.running_batch()
        if victims and now - c.last_evict >= interval:
            c.last_evict = now
            await c.evict(victims[0], reason=f"load {load} > {spec.evict_above}", held=False)
        return None
    due: float | None = None
    waiting = sorted(
        (e for e in c.engines.values() if not e.serving and not e.held), key=lambda e: -e.priority
    )
    for e in waiting:  # crashed batch engines come back after their backoff
        if e.state == "dead" and now < e.next_start:
            due = _earliest(due, e.next_start)
        elif e.state == "dead" and c.fits(e.memory_mb):
            await c.spawn(e)
    if load >= spec.respawn_below:
        c.low_since = None
        return due
    c.low_since = c.low_since or now
    for e in waiting:  # evicted ones once the load stayed low for respawn_hold_s
        if e.state != "evicted":
            continue
        if now - c.low_since < spec.respawn_hold_s:
            due = _earliest(due, c.low_since + spec.respawn_hold_s)
        elif c.fits(e.memory_mb):
            await c.spawn(e)
    return due


async def handle(
    c: Cluster, req: StatusReq | PromoteReq | EvictReq | RestartReq | StopReq, stop: asyncio.Event
) -> ControlReply:
    """Answer one operator request; StopReq sets `stop`."""
    if isinstance(req, StatusReq):
        return ControlReply(ok=True, status=c.snapshot())
    if isinstance(req, StopReq):
        stop.set()
        return ControlReply(ok=True, message="stopping")
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


async def _promote(c: Cluster, e: Engine) -> ControlReply:
    if e.state != "standby":
        raise ControlError(
            f"{e.name} is {e.state}; only a ready standby can be promoted (see `supervisor status`)"
        )
    old = c.primary
    t0 = time.monotonic()
    if old is not None:
        inc = old.inc
        if inc is not None:
            inc.handled = True
            for p in inc.procs:
                await p.fence()
            old.state, c.primary = "dead", None
            old.next_start = time.monotonic()
            c.publish(old, "fenced", cause="operator-promote", pid=inc.pid)
            old.role = "standby"  # it restarts as one; `fenced` says what it was
    c.promote(e, t0, cause="operator", old=old.name if old else None)
    c.wake.set()
    return ControlReply(ok=True, message=f"{e.name} is primary at epoch {c.epoch}")


async def _restart(c: Cluster, e: Engine) -> ControlReply:
    if e.running:
        await c.fence(e, cause="operator-restart", detail="restarted by hand", counted=False)
    e.state = "dead"
    e.held = False
    e.next_start = time.monotonic()
    e.book.reset()
    c.wake.set()
    return ControlReply(ok=True, message=f"{e.name} restarting")
