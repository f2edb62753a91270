"""One trial: wait for a whole crew, inject one fault, measure until the crew is whole again."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import structlog

from chaos.broker import OwnBroker
from chaos.cluster import Supervisor, describe_exit
from chaos.crew import missing
from chaos.errors import CrewError, CrewTimeout, VictimComing
from chaos.evidence import DaemonLogs, fence_before_promote
from chaos.faults import FaultContext, Injection, heal, inject
from chaos.load import LoadGenerator
from chaos.metrics import DAEMON_FAULTS, ENGINE_KILLS, PRIMARY_FAULTS, TrialRow, expected
from chaos.models import UPDATE_FAULTS, Checkpoints
from chaos.procs import ProcRef
from chaos.recorder import EventRecorder, EventRow
from chaos.scenario import FaultSpec, Scenario
from chaos.updates import Ended, until_ended
from holdfast_contract.control import CrewStatus
from holdfast_contract.events import EventName

log = structlog.get_logger("chaos.trial")

WAKE_S = 0.25  # re-read /cluster at least this often while waiting for the crew
QUIET_S = 5.0  # a wait longer than this is logged (and again every LOUD_EVERY_S)
LOUD_EVERY_S = 10.0


def _silent(_: str) -> None:
    pass


EVENT_GRACE_S = 1.0  # after recovery, how long events already emitted may take to arrive


class Harness(msgspec.Struct):
    """Everything a trial drives or watches, for one stage."""

    scenario: Scenario
    stage: str
    sup: Supervisor
    broker: OwnBroker | None
    recorder: EventRecorder
    load: LoadGenerator
    logs: DaemonLogs
    status: Callable[[str], None] = _silent  # what the run waits for, "" when it waits no more
    checkpoints: Checkpoints | None = None  # the dirs of the stage's update and refit models
    one_pool: int = 0  # pool bytes held at the stage's first whole crew (chaos/pools.py)
    served: set[str] = msgspec.field(default_factory=set)  # versions /cluster said it served


async def wait_ready(h: Harness, timeout: float, since: float) -> CrewStatus:
    """The crew's status once it is as whole as the policy wants it now.

    While it waits, `h.status` says what for (and a long wait is logged); CrewTimeout after
    `timeout`, CrewError at once when the supervisor exits."""
    began = time.monotonic()
    deadline, loud_at = began + timeout, began + QUIET_S
    lacking = ["an answer from the health API"]
    while time.monotonic() < deadline:
        view = await h.sup.cluster()
        if view is not None:
            h.load.fallback = (view.primary or "", view.epoch)
            h.served.update([view.version] if view.version else [])
            lacking = missing(view, h.sup.policy, h.scenario.ready_standbys)
            if not lacking:
                h.status("")
                return view
        if h.sup.exited() is not None:
            raise CrewError(describe_exit(h.sup, since))
        waited = time.monotonic() - began
        h.status(f"waiting {waited:.0f}s for {'; '.join(lacking)}")
        if time.monotonic() >= loud_at:
            loud_at += LOUD_EVERY_S
            log.warning("waiting_for_pool", stage=h.stage, waited_s=round(waited), lacking=lacking)
        await h.recorder.changed(min(WAKE_S, max(0.0, deadline - time.monotonic())))
    h.status("")
    raise CrewTimeout(
        f"the pool was not whole within ready_timeout_s={timeout:g}s; still lacking: "
        f"{'; '.join(lacking)} (policy {h.sup.policy_file}, log {h.sup.log_file})"
    )


async def run_trial(h: Harness, index: int, fault: FaultSpec) -> TrialRow:
    sc = h.scenario
    since, until = time.time(), time.monotonic() + sc.ready_timeout_s
    while True:  # until the crew is whole and the victim there (one on its way: wait again)
        try:
            await wait_ready(h, max(0.0, until - time.monotonic()), since)
        except CrewTimeout as exc:
            return not_injected(h, index, fault, str(exc), outcome="failed")
        await asyncio.sleep(sc.settle_s)
        view = await h.sup.cluster()
        if view is None:
            raise CrewError(f"the health API {h.sup.api} stopped answering")
        ctx = FaultContext(h.sup, h.broker, view, fault, h.checkpoints)
        h.logs.set_mark()
        try:
            injection = await inject(fault.kind, ctx)
            break
        except VictimComing as exc:
            if time.monotonic() >= until:
                why = f"{exc}, still after ready_timeout_s={sc.ready_timeout_s:g}s"
                return not_injected(h, index, fault, why, outcome="failed")
            h.status(str(exc))
            await h.recorder.changed(WAKE_S)
    ranks = _ranks(view, injection) if fault.kind in ENGINE_KILLS else None
    log.info("fault", index=index, kind=fault.kind, victims=[v.name for v in injection.victims])
    deadline = time.monotonic() + sc.trial_timeout_s
    async with asyncio.TaskGroup() as group:
        detected = group.create_task(h.recorder.wait_for(_about(injection), sc.trial_timeout_s))
        promoted = group.create_task(
            h.recorder.wait_for(_promoted(injection.injected), sc.trial_timeout_s)
        )
        await heal(fault.kind, ctx, injection)
        ended = await _update_end(h, fault, injection, deadline)
        if expected("detection_ms", fault.kind):
            limit = min(sc.detect_timeout_s, deadline - time.monotonic())
            await asyncio.wait([detected], timeout=max(limit, 0.0))
        note = await _recovered(h, injection, deadline)
        # /cluster may show the new crew a moment before its events arrive over zmq.
        due = [detected] if expected("detection_ms", fault.kind) else []
        due += [promoted] if fault.kind in PRIMARY_FAULTS else []
        if due:
            grace = min(EVENT_GRACE_S, deadline - time.monotonic())
            await asyncio.wait(due, timeout=max(grace, 0.0))
        for task in (detected, promoted):
            if not task.done():
                task.cancel()
    return TrialRow(
        index=index,
        stage=h.stage,
        fault=fault.kind,
        victim="+".join(f"{v.kind}:{v.name}" for v in injection.victims),
        pid=injection.victims[0].ref.pid if injection.victims[0].ref else None,
        injected=injection.injected,
        ended=time.time(),
        detection_ms=_ms(detected, injection),
        promotion_ms=_ms(promoted, injection) if fault.kind in PRIMARY_FAULTS else None,
        lingering=injection.lingering,
        note="; ".join(n for n in (injection.note, ended.said() if ended else "", note) if n),
        fence_before_promote=_fence_order(h, fault.kind, injection),
        checkpoint_bytes_read=h.logs.bytes_read_since_mark()
        if fault.kind in DAEMON_FAULTS
        else None,
        group_left=sum(ref.alive() for ref in ranks) if ranks is not None else None,
        update_ms=ended.ms if ended else None,
        rolled_back=int(ended.state == "rolled-back") if ended and ended.state else None,
        unexpected_end=int(ended.state != fault.expect) if ended else None,
        pool_copies=ended.copies(h.one_pool) if ended else None,
        peak_pool_copies=ended.copies(h.one_pool, ended.peak_bytes) if ended else None,
    )


async def _update_end(
    h: Harness, fault: FaultSpec, injection: Injection, deadline: float
) -> Ended | None:
    """An update's or a refit's end (None for other faults); what serves now follows it."""
    if fault.kind not in UPDATE_FAULTS:
        return None
    target = Path(injection.model)
    left = max(deadline - time.monotonic(), 0.0)
    ended = await until_ended(
        h.sup, fault.kind, target, injection.injected, left, h.recorder.changed
    )
    if h.checkpoints is not None and ended.state != "rolled-back":
        h.checkpoints.serving = target if ended.state == "finished" else None
    return ended


def _ranks(view: CrewStatus, injection: Injection) -> list[ProcRef]:
    """Every rank process of the killed engines, as /cluster listed them before the fault:
    one_for_all means none may outlive the trial."""
    refs = []
    for victim in injection.victims:
        engine = view.engine(victim.name) if victim.kind == "engine" else None
        pids = (engine.pids or ([engine.pid] if engine.pid else [])) if engine else []
        refs += [ref for ref in map(ProcRef.of, pids) if ref is not None]
    return refs


def _fence_order(h: Harness, kind: str, injection: Injection) -> float | None:
    """Only a hang needs fencing: a killed primary is gone before anything is promoted."""
    engines = [v.name for v in injection.victims if v.kind == "engine"]
    if kind != "stop-primary" or not engines:
        return None
    return fence_before_promote(h.recorder.rows, engines[0], injection.injected)


def not_injected(
    h: Harness, index: int, fault: FaultSpec, why: str, *, outcome: str = "failed"
) -> TrialRow:
    """A trial whose fault was never injected: `failed` counts as a timeout in every check,
    `skipped` (its victim does not exist now, by the policy's own rule) measures nothing."""
    now = time.time()
    return TrialRow(
        index=index,
        stage=h.stage,
        fault=fault.kind,
        victim="",
        pid=None,
        injected=now,
        ended=now,
        detection_ms=None,
        promotion_ms=None,
        outcome=outcome,
        note=f"not injected: {why}",
    )


async def _recovered(h: Harness, injection: Injection, deadline: float) -> str:
    """Wait for a successful request started after the fault, then for a whole crew."""
    left = deadline - time.monotonic()
    if await h.load.first_ok_after(injection.injected, max(left, 0.0)) is None:
        return "no successful request before the trial timeout"
    try:
        await wait_ready(h, max(deadline - time.monotonic(), 0.0), injection.injected)
    except CrewError as exc:
        return f"pool not whole again before the trial timeout: {exc}"[:600]
    return ""


def _about(injection: Injection) -> Callable[[EventRow], bool]:
    targets = {(v.kind, v.name) for v in injection.victims if v.kind in ("engine", "supervisor")}
    daemon = any(v.kind == "daemon" for v in injection.victims)

    def match(ev: EventRow) -> bool:
        if ev.ts < injection.injected:
            return False
        # a daemon's death or hang is what detects a daemon fault; a spare standing by or
        # a crew serving again are not
        return (ev.kind, ev.name) in targets or (
            daemon and ev.kind == "daemon" and ev.event in (EventName.DEAD, EventName.HUNG)
        )

    return match


def _promoted(since: float) -> Callable[[EventRow], bool]:
    def match(ev: EventRow) -> bool:
        return ev.ts >= since and ev.kind == "engine" and ev.event == EventName.PROMOTED

    return match


def _ms(task: asyncio.Task[EventRow | None], injection: Injection) -> float | None:
    if not task.done() or task.cancelled() or task.result() is None:
        return None
    row = task.result()
    return round((row.ts - injection.injected) * 1000.0, 2) if row is not None else None
