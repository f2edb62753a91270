"""A whole chaos run: per stage, start broker + supervisor, drive load, run the trials; then
the report. Ctrl-C stops the faults and the load, stops every process, writes what it has."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import msgspec
import structlog
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from chaos import report, throughput
from chaos.broker import OwnBroker
from chaos.cluster import Supervisor, derive_policy, write_policy
from chaos.errors import ChaosError, FaultError, VictimAbsent
from chaos.evidence import DaemonLogs
from chaos.load import LoadGenerator, RequestRow, describe_load
from chaos.metrics import StageSpan, TrialRow, baseline_ms, evaluate, run_figures, with_requests
from chaos.models import Checkpoints, prepare
from chaos.pools import pool_bytes
from chaos.preflight import preflight
from chaos.recorder import EventRecorder, EventRow, MqttTarget
from chaos.scenario import FaultSpec, Plan, Stage
from chaos.trial import Harness, not_injected, run_trial, wait_ready
from supervisor.policy import MqttSpec
from supervisor.policy_file import load_policy

log = structlog.get_logger("chaos.runner")


class RunOptions(msgspec.Struct, frozen=True):
    out: Path
    command: str
    policy: Path | None = None  # replaces every stage's policy
    attach: bool = False  # drive a supervisor that already runs this policy
    progress: bool = True


class Collected(msgspec.Struct):
    trials: list[TrialRow] = []
    requests: list[RequestRow] = []
    events: list[EventRow] = []
    stages: list[StageSpan] = []
    baseline_before: float | None = None
    lingering_after_stop: int = 0
    notes: list[str] = []
    served: set[str] = msgspec.field(default_factory=set)  # versions /cluster said it served


async def run(plan: Plan, opts: RunOptions) -> tuple[report.Results, bool]:
    """Returns the results and whether the run was interrupted (Ctrl-C)."""
    preflight(plan, opts.policy, attached=opts.attach)
    started = datetime.now(UTC)
    got = Collected()
    interrupted = False
    with _progress(opts) as progress:
        try:
            for stage, faults in zip(plan.scenario.stages, plan.order, strict=True):
                await _guarded_stage(plan, stage, faults, opts, got, progress)
        except asyncio.CancelledError:
            interrupted = True
            got.notes.append("interrupted (Ctrl-C or SIGTERM); partial results")
    results = _results(plan, opts, got, started, complete=not got.notes)
    write_report(opts.out, results)
    return results, interrupted


async def _guarded_stage(
    plan: Plan,
    stage: Stage,
    faults: list[FaultSpec],
    opts: RunOptions,
    got: Collected,
    progress: Progress,
) -> None:
    """A stage that cannot go on becomes a note in the report; the next stage still runs."""
    try:
        await _stage(plan, stage, faults, opts, got, progress)
    except* ChaosError as group:
        for exc in _leaves(group):
            got.notes.append(f"stage {stage.name}: {exc}")
            log.error("stage_failed", stage=stage.name, error=str(exc))


async def _stage(
    plan: Plan,
    stage: Stage,
    faults: list[FaultSpec],
    opts: RunOptions,
    got: Collected,
    progress: Progress,
) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="hf-chaos-"))  # short: unix socket paths
    stage_out = opts.out / stage.name
    stage_out.mkdir(parents=True, exist_ok=True)
    try:
        async with contextlib.AsyncExitStack() as stack:
            broker = None if opts.attach else await stack.enter_async_context(OwnBroker(workdir))
            sup = await stack.enter_async_context(_supervisor(plan, stage, opts, workdir, broker))
            refs = [model for fault in faults for model in fault.models]
            ckpts = await prepare(refs, plan.source.parent, sup.policy, workdir) if refs else None
            await _drive(plan, stage, faults, sup, broker, got, progress, ckpts)
            if not sup.attached:  # an attached supervisor is left running, as found
                await _stop_and_count(sup, got)
    finally:
        if (workdir / "supervisor.log").exists():
            shutil.copy2(workdir / "supervisor.log", stage_out)
        if (workdir / "run" / "logs").is_dir():  # the daemons' and engines' own logs
            shutil.copytree(workdir / "run" / "logs", stage_out / "logs", dirs_exist_ok=True)
        shutil.rmtree(workdir, ignore_errors=True)


async def _stop_and_count(sup: Supervisor, got: Collected) -> None:
    """Stop the supervisor cleanly; every child it had must be gone soon after."""
    left = await sup.stop()
    got.lingering_after_stop += len(left)
    if left:
        got.notes.append(f"{len(left)} processes outlived a clean supervisor stop")


def _supervisor(
    plan: Plan, stage: Stage, opts: RunOptions, workdir: Path, broker: OwnBroker | None
) -> Supervisor:
    source = opts.policy or plan.policy_path(stage)
    if opts.attach:
        policy = load_policy(source)
        return Supervisor(policy, source, workdir / "supervisor.log", attached=True)
    mqtt = MqttSpec(host=broker.host, port=broker.port) if broker is not None else None
    policy = derive_policy(source, workdir / "run", mqtt, stage.policy_overrides)
    policy_file = write_policy(policy, opts.out / stage.name / "policy.yaml")
    return Supervisor(policy, policy_file, workdir / "supervisor.log")


async def _drive(
    plan: Plan,
    stage: Stage,
    faults: list[FaultSpec],
    sup: Supervisor,
    broker: OwnBroker | None,
    got: Collected,
    progress: Progress,
    ckpts: Checkpoints | None = None,
) -> None:
    sc = plan.scenario
    mqtt = sup.policy.events.mqtt
    target = MqttTarget(mqtt.host, mqtt.port, f"{mqtt.prefix}/events") if mqtt else None
    recorder = EventRecorder(sup.run_dir, target)
    load = LoadGenerator(sup.router, sc.load, seed=sc.seed)
    h = Harness(
        sc, stage.name, sup, broker, recorder, load, DaemonLogs(sup.run_dir), checkpoints=ckpts
    )
    stop_recorder, stop_load = asyncio.Event(), asyncio.Event()
    began = time.time()
    task = progress.add_task(f"{stage.name}: starting", total=len(faults))
    h.status = _status(progress, task, f"{stage.name}: starting")
    loaded = began
    try:
        async with asyncio.TaskGroup() as group:
            group.create_task(recorder.run(stop_recorder))
            try:
                if not sup.attached:
                    await sup.start()
                await wait_ready(h, sc.start_timeout_s or sc.ready_timeout_s, began)
                h.one_pool = pool_bytes(sup.processes())  # one version serves: one pool
                loaded = time.time()
                group.create_task(load.run(stop_load, duration_s=sc.load.max_duration_s))
                await asyncio.sleep(sc.warmup_s)
                got.baseline_before = got.baseline_before or time.time()
                await _trials(h, faults, got, progress, task)
            finally:
                stop_load.set()
                stop_recorder.set()
    finally:
        got.stages.append(StageSpan(stage.name, loaded, time.time()))
        base = baseline_ms(load.rows, got.baseline_before or time.time())
        mine = [t for t in got.trials if t.stage == stage.name]
        got.trials[len(got.trials) - len(mine) :] = [
            with_requests(t, load.rows, base, mine, recorder.rows) for t in mine
        ]
        got.requests += load.rows
        got.events += recorder.rows
        got.served |= h.served


def _status(progress: Progress, task: TaskID, title: str) -> Callable[[str], None]:
    """Shows what a stage waits for next to its title on the progress line."""

    def show(text: str) -> None:
        progress.update(task, description=f"{title} ({text})" if text else title)

    show("")
    return show


async def _trials(
    h: Harness, faults: list[FaultSpec], got: Collected, progress: Progress, task: TaskID
) -> None:
    for fault in faults:
        h.status = _status(progress, task, f"{h.stage}: {fault.kind}")
        index = len(got.trials)
        try:
            got.trials.append(await run_trial(h, index, fault))
        except VictimAbsent as exc:  # nothing to hit, by the policy's own rule: measured nothing
            got.trials.append(not_injected(h, index, fault, str(exc), outcome="skipped"))
        except FaultError as exc:  # counted as a trial with nothing measured: checks see it
            got.trials.append(not_injected(h, index, fault, str(exc)))
        progress.advance(task)


def _results(
    plan: Plan, opts: RunOptions, got: Collected, started: datetime, *, complete: bool
) -> report.Results:
    base = baseline_ms(got.requests, got.baseline_before or time.time())
    figures = run_figures(got.requests, got.trials, base, got.served)
    figures = msgspec.structs.replace(
        figures, lingering_processes=figures.lingering_processes + got.lingering_after_stop
    )
    checks = [evaluate(check, got.trials, figures) for check in plan.checks]
    before = throughput.baseline(got.requests, got.stages, got.baseline_before)
    meta = report.RunMeta(
        scenario=plan.scenario.name,
        command=opts.command,
        started=_iso(started),
        finished=_iso(datetime.now(UTC)),
        machine=report.machine(),
        complete=complete,
        note="; ".join(got.notes),
        load=describe_load(plan.scenario.load),
    )
    return report.Results(
        meta,
        figures,
        checks,
        got.trials,
        got.requests,
        got.events,
        got.stages,
        before,
        throughput.per_fault(got.requests, got.trials, before),
    )


def write_report(out: Path, results: report.Results) -> None:
    """report.md, results.json and the plots, in `out`."""
    from chaos import plots  # matplotlib costs a second: only once there is something to plot

    report.write(out, results)
    plots.timeline(out / "timeline.png", results.requests, results.trials, results.stages)
    plots.recovery(out / "recovery.png", results.trials)


def _leaves(group: BaseExceptionGroup[ChaosError]) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out += _leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc]
    return out


def _iso(when: datetime) -> str:
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def _progress(opts: RunOptions) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        disable=not opts.progress,
        transient=False,
    )
