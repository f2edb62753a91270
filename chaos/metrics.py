"""Per-trial and whole-run figures from the raw rows, and the checks evaluated on them."""

from __future__ import annotations

import collections
import math
import statistics
from collections.abc import Callable, Collection, Iterable, Sequence

import msgspec

from chaos import twins as tw
from chaos.checks import Check
from chaos.load import RequestRow
from chaos.models import UPDATE_FAULTS
from chaos.recorder import EventRow
from holdfast_contract.events import EventName as N

PRIMARY_FAULTS = frozenset(
    {"kill-primary", "stop-primary", "kill-tp-rank", "kill-daemon-and-primary", "restart-broker"}
)
DAEMON_FAULTS = frozenset({"kill-daemon", "stop-daemon", "kill-daemon-and-primary"})
ENGINE_KILLS = frozenset(
    {"kill-primary", "kill-standby", "kill-batch", "kill-tp-rank", "kill-daemon-and-primary"}
)
MS_METRICS = ("detection_ms", "promotion_ms", "recovery_ms", "added_latency_ms")
COUNTS = ("failed_requests", "retried_requests", "shed_requests")
EVIDENCE = ("fence_before_promote", "checkpoint_bytes_read", "group_left")
UPDATE_METRICS = ("update_ms", "rolled_back", "unexpected_end", "pool_copies", "peak_pool_copies")
UPDATES = (*UPDATE_METRICS, "unlabelled_answers")
STREAMS = (
    "broken_streams",
    "migrated_streams",
    "twin_mismatches",
    "stream_stall_ms",
    "stream_stall_p50_ms",
    "adopted_streams",
    "kept_streams",
    "replayed_streams",
    "continuation_prefill_tokens",
)


class TrialRow(msgspec.Struct, frozen=True):
    index: int
    stage: str
    fault: str
    victim: str  # engine name, daemon-<rank>, broker, supervisor
    pid: int | None
    injected: float  # wall clock, seconds
    ended: float
    detection_ms: float | None
    promotion_ms: float | None
    recovery_ms: float | None = None
    failed_requests: int = 0
    retried_requests: int = 0
    added_latency_ms: float | None = None
    lingering: int = 0
    note: str = ""
    outcome: str = "injected"  # injected | skipped (no victim, by the policy's rule) | failed
    shed_requests: int = 0  # answered 503 + Retry-After on every attempt (overload, not failure)
    fence_before_promote: float | None = None  # 1: the victim's fence came first in the events
    checkpoint_bytes_read: float | None = None  # by the daemon that took over (its log)
    group_left: int | None = None  # the killed engine's rank processes alive once recovered
    broken_streams: int = 0  # streams that did not end complete (counted in failed_requests)
    migrated_streams: int = 0  # streams the router continued on the next primary
    twin_mismatches: int = 0  # complete greedy streams whose tokens differ from their twins'
    stream_stall_ms: float | None = None  # the longest stall a migrated stream showed
    stream_stall_p50_ms: float | None = None  # the median of the migrated streams' stalls
    # the router's continuations in the trial: from the dead primary's KV cache, from a past
    # kept warm, computed again; and the prompt tokens their prefills computed in all
    adopted_streams: int = 0
    kept_streams: int = 0
    replayed_streams: int = 0
    continuation_prefill_tokens: int = 0
    unlabelled_answers: int = 0  # successful answers that did not name their model version
    update_ms: float | None = None  # update, refit: the request -> finished or rolled back
    rolled_back: int | None = None  # update, refit: 1 when it ended rolled back
    unexpected_end: int | None = None  # 1 when it did not end as the fault's `expect` says
    pool_copies: float | None = None  # pool memory held once it ended, in pools (chaos/pools.py)
    peak_pool_copies: float | None = None  # ... the most while it ran


class StageSpan(msgspec.Struct, frozen=True):
    name: str
    start: float  # wall clock: the stage's load began
    end: float  # ... and stopped


class RunFigures(msgspec.Struct, frozen=True):
    requests: int
    failed_requests: int
    retried_requests: int
    availability: float | None
    baseline_p50_ms: float | None
    lingering_processes: int
    faults: int  # injected
    shed_requests: int = 0
    availability_excl_kill_supervisor: float | None = None
    skipped_faults: int = 0
    failed_trials: int = 0  # never injected: the crew was not whole in time, or no victim
    streams: int = 0
    broken_streams: int = 0
    migrated_streams: int = 0
    twin_mismatches: int = 0
    migrated_twin_mismatches: int = 0  # of those, streams the router continued
    unlabelled_answers: int = 0  # successful answers that did not name their model version
    unserved_versions: int = 0  # successful answers of a version the router never served
    versions: int = 0  # model versions that made a successful answer
    twin_versions_alike: int = 0  # twin prompts that two versions answered alike
    served_versions: list[str] = []  # every version /cluster said the router served


class CheckResult(msgspec.Struct, frozen=True):
    check: str
    value: float | None
    passed: bool


def expected(metric: str, fault: str) -> bool:
    """Whether a trial of `fault` must produce `metric` (a missing one then counts as inf)."""
    if metric == "promotion_ms":
        return fault in PRIMARY_FAULTS
    if metric == "detection_ms":  # (nothing detects an update: it was asked for)
        return fault not in {"restart-broker", "kill-supervisor", *UPDATE_FAULTS}
    if metric == "checkpoint_bytes_read":
        return fault in DAEMON_FAULTS
    if metric == "fence_before_promote":
        return fault == "stop-primary"
    if metric in UPDATE_METRICS:
        return fault in UPDATE_FAULTS
    return metric == "recovery_ms"  # added latency needs a baseline: without one it is n/a


def with_requests(
    trial: TrialRow,
    rows: Sequence[RequestRow],
    baseline_ms: float | None,
    trials: Sequence[TrialRow] = (),
    events: Sequence[EventRow] = (),
) -> TrialRow:
    """Fill the request-side figures of one trial from the requests started inside it; a
    failed request counts against the fault in force when it failed (see `blamed`), so
    `trials` (all of the stage's, this one among them) decides where failures go. The
    router's `migrated` events inside it (`events`) say how its continuations began."""
    inside = [r for r in rows if trial.injected <= r.start < trial.ended]
    everyone = trials or [trial]
    failed = [r for r in rows if r.failed and blamed(r, everyone) is trial]
    overlapping = [r for r in rows if r.start < trial.ended and r.end >= trial.injected]
    first_ok = min((r.end for r in inside if r.ok), default=None)
    slowest = max((r.latency_ms for r in overlapping), default=None)
    added = None
    if slowest is not None and baseline_ms is not None:
        added = round(max(0.0, slowest - baseline_ms), 2)
    recovery = (first_ok - trial.injected) * 1000.0 if first_ok is not None else None
    # a stream the fault cut began before it: streams count where they were under way
    twins = tw.references(rows)
    cut = [r for r in overlapping if r.migrated and blamed_cut(r, everyone) is trial]
    stalls = [r.stall_ms for r in cut if r.stall_ms is not None]
    # (each event comes on the supervisor's socket and over MQTT: counted once)
    moved = list(
        {
            (e.ts, e.name, repr(sorted(e.detail.items()))): e.detail
            for e in events
            if e.kind == "router" and e.event == N.MIGRATED and trial.injected <= e.ts < trial.ended
        }.values()
    )
    began = collections.Counter(str(d.get("continued", "replayed")) for d in moved)
    return msgspec.structs.replace(
        trial,
        adopted_streams=began["adopted"],
        kept_streams=began["kept"],
        replayed_streams=began["replayed"],
        continuation_prefill_tokens=sum(int(d.get("prefill", 0)) for d in moved),
        broken_streams=sum(1 for r in failed if r.broken),
        migrated_streams=len(cut),
        twin_mismatches=sum(
            1
            for r in overlapping
            if tw.mismatched(r, twins)
            and (blamed_cut(r, everyone) or trial_of(r, everyone)) is trial
        ),
        stream_stall_ms=round(max(stalls), 3) if stalls else None,
        stream_stall_p50_ms=round(statistics.median(stalls), 3) if stalls else None,
        recovery_ms=round(recovery, 2) if recovery is not None else None,
        failed_requests=len(failed),
        retried_requests=sum(1 for r in inside if r.attempts > 1),
        shed_requests=sum(1 for r in inside if r.shed),
        added_latency_ms=added,
        unlabelled_answers=sum(1 for r in inside if tw.unlabelled(r)),
    )


def blamed_cut(row: RequestRow, trials: Sequence[TrialRow]) -> TrialRow | None:
    """The trial a migrated stream counts in: the last fault injected while it ran."""
    during = [t for t in trials if row.start <= t.injected <= row.end]
    return max(during, key=lambda t: t.injected, default=None)


def trial_of(row: RequestRow, trials: Sequence[TrialRow]) -> TrialRow | None:
    """The trial a request started in, if any."""
    return next((t for t in trials if t.injected <= row.start < t.ended), None)


def blamed(row: RequestRow, trials: Sequence[TrialRow]) -> TrialRow | None:
    """The trial a request is counted in: a failed one against the last fault injected before
    it gave up (a request started late in one trial that fails because the next trial killed
    the supervisor is that kill's failure), any other one where it started."""
    if not row.failed:
        return trial_of(row, trials)
    before = [t for t in trials if t.injected <= row.end]
    return max(before, key=lambda t: t.injected, default=None)


def _availability(rows: Sequence[RequestRow]) -> float | None:
    """Successful / (successful + failed); shed requests (overload) are in neither."""
    ok = sum(1 for r in rows if r.ok)
    failed = sum(1 for r in rows if r.failed)
    return round(ok / (ok + failed), 6) if ok + failed else None


def baseline_ms(rows: Sequence[RequestRow], before: float) -> float | None:
    latencies = [r.latency_ms for r in rows if r.ok and r.end < before]
    return statistics.median(latencies) if latencies else None


def run_figures(
    rows: Sequence[RequestRow],
    trials: Sequence[TrialRow],
    base: float | None,
    served: Collection[str] = (),
) -> RunFigures:
    """The whole run's figures; `served`: the model versions /cluster named as served."""
    outside = [r for r in rows if (t := blamed(r, trials)) is None or t.fault != "kill-supervisor"]
    twins = tw.references(rows)
    return RunFigures(
        requests=len(rows),
        failed_requests=sum(1 for r in rows if r.failed),
        retried_requests=sum(1 for r in rows if r.attempts > 1),
        availability=_availability(rows),
        baseline_p50_ms=round(base, 2) if base is not None else None,
        lingering_processes=sum(t.lingering for t in trials),
        faults=sum(1 for t in trials if t.outcome == "injected"),
        shed_requests=sum(1 for r in rows if r.shed),
        availability_excl_kill_supervisor=_availability(outside),
        skipped_faults=sum(1 for t in trials if t.outcome == "skipped"),
        failed_trials=sum(1 for t in trials if t.outcome == "failed"),
        streams=sum(1 for r in rows if r.streamed),
        broken_streams=sum(1 for r in rows if r.broken),
        migrated_streams=sum(1 for r in rows if r.migrated),
        twin_mismatches=sum(1 for r in rows if tw.mismatched(r, twins)),
        migrated_twin_mismatches=sum(1 for r in rows if r.migrated and tw.mismatched(r, twins)),
        unlabelled_answers=sum(1 for r in rows if tw.unlabelled(r)),
        unserved_versions=tw.unserved(rows, served),
        versions=tw.versions(rows),
        twin_versions_alike=tw.alike(twins),
        served_versions=sorted(served),
    )


def values(trials: Iterable[TrialRow], metric: str) -> list[float]:
    out: list[float] = []
    for trial in trials:
        if trial.outcome == "skipped":  # nothing was injected, by the policy's rule
            continue
        if metric == "detection_ms" and not expected(metric, trial.fault):
            continue  # kill-supervisor's is the new supervisor's start: not a detection
        value = getattr(trial, metric)
        if value is None and expected(metric, trial.fault):
            out.append(math.inf)
        elif value is not None:
            out.append(float(value))
    return out


def stat(data: Sequence[float], name: str) -> float | None:
    if name == "count":
        return float(len(data))
    if not data:
        return None
    ordered = sorted(data)
    if name.startswith("p"):
        rank = math.ceil(int(name[1:]) / 100.0 * len(ordered))
        return ordered[max(rank, 1) - 1]
    reducers: dict[str, Callable[[list[float]], float]] = {
        "max": max,
        "min": min,
        "sum": math.fsum,
        "mean": statistics.fmean,
    }
    return float(reducers[name](ordered))


def evaluate(check: Check, trials: Sequence[TrialRow], run: RunFigures) -> CheckResult:
    if check.stat is None:
        value = getattr(run, check.metric)
        figure = float(value) if value is not None else None
    else:
        scoped = [t for t in trials if check.scope is None or t.fault == check.scope]
        figure = stat(values(scoped, check.metric), check.stat)
    return CheckResult(check.text, figure, check.holds(figure))
