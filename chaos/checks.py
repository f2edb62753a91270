"""Checks: `[fault.]metric[.stat] OP number`, parsed by a tiny grammar (never eval).

promotion_ms.p99 < 100            every trial that measured promotion
kill-primary.failed_requests == 0  summed over that fault's trials
availability >= 0.999             the whole run
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Mapping

import msgspec

from chaos.errors import CheckSyntaxError
from chaos.fleet.kinds import FLEET_METRICS

TRIAL_METRICS: dict[str, str] = {
    "detection_ms": "fault -> first supervisor event about the victim",
    "promotion_ms": "fault -> a standby promoted (primary faults)",
    "recovery_ms": "fault -> end of the first successful request started after it",
    "failed_requests": "requests that failed after every retry during the trial",
    "retried_requests": "requests that needed more than one attempt during the trial",
    "added_latency_ms": "slowest request of the trial minus the baseline median latency",
    "shed_requests": "requests the engine shed (503 + Retry-After on every attempt)",
    "fence_before_promote": "1 when the victim's `fenced` event came before `promoted`, else 0",
    "checkpoint_bytes_read": "checkpoint bytes the daemon that took over read (daemon faults)",
    "group_left": "processes of the killed engine's group (every rank) alive once recovered",
    "broken_streams": "streams that did not end complete (error event, cut, short)",
    "migrated_streams": "streams the router continued on the next primary",
    "twin_mismatches": "whole greedy answers unlike their twins' (same prompt and version)",
    "stream_stall_ms": "the longest stall a migrated stream showed its client in the trial",
    "stream_stall_p50_ms": "the median stall of the trial's migrated streams",
    "adopted_streams": "continuations that began from the dead primary's KV cache (kv_adopt)",
    "kept_streams": "continuations that began from a past kept warm on the standby",
    "replayed_streams": "continuations that computed their whole past again (token replay)",
    "continuation_prefill_tokens": "prompt tokens the trial's continuations prefilled in all",
    "unlabelled_answers": "successful answers without their model version (header, fingerprint)",
    "update_ms": "update, refit: the request -> finished or rolled back",
    "rolled_back": "update, refit: 1 when it ended rolled back, else 0",
    "unexpected_end": "update, refit: 1 when it did not end as the fault's `expect` says",
    "pool_copies": "update, refit: model pool memory held once it ended, in pools",
    "peak_pool_copies": "update, refit: the most pool memory held while it ran, in pools",
    **FLEET_METRICS,
}
RUN_METRICS: dict[str, str] = {
    "availability": "successful / (successful + failed) requests, whole run (shed excluded)",
    "availability_excl_kill_supervisor": "availability of requests outside kill-supervisor trials",
    "requests": "requests sent, whole run",
    "failed_requests": "failed requests, whole run",
    "shed_requests": "requests shed by an overloaded engine (503 + Retry-After), whole run",
    "retried_requests": "retried requests, whole run",
    "lingering_processes": "processes left behind by a killed or stopped supervisor",
    "faults": "faults injected",
    "skipped_faults": "faults not injected because the policy runs no victim now",
    "failed_trials": "trials never injected: the pool was not whole in time, or no victim",
    "streams": "streamed requests, whole run",
    "broken_streams": "streams that did not end complete, whole run",
    "migrated_streams": "streams continued on the next primary, whole run",
    "twin_mismatches": "whole greedy answers unlike their fault-free twins, whole run",
    "migrated_twin_mismatches": "of those, streams continued on the next primary, whole run",
    "unlabelled_answers": "successful answers without their model version, whole run",
    "unserved_versions": "successful answers of a model version the router never served",
    "versions": "model versions that made a successful answer",
    "twin_versions_alike": "twin prompts two model versions answered alike (mixing unseen)",
}
STATS = ("p50", "p95", "p99", "max", "min", "mean", "count", "sum")
COUNT_METRICS = frozenset(
    {
        "failed_requests",
        "retried_requests",
        "shed_requests",
        "failed_elsewhere",
        "leader_changes",
        "broken_streams",
        "migrated_streams",
        "twin_mismatches",
        "migrated_twin_mismatches",
        "unlabelled_answers",
        "rolled_back",
        "unexpected_end",
    }
)
_OPS: dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le,
    ">=": operator.ge,
    "==": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    ">": operator.gt,
}
_GRAMMAR = re.compile(
    r"^\s*(?P<path>[A-Za-z0-9_\-]+(?:\.[A-Za-z0-9_\-]+){0,2})\s*"
    r"(?P<op><=|>=|==|!=|<|>)\s*"
    r"(?P<num>[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*$"
)


class Check(msgspec.Struct, frozen=True):
    text: str
    scope: str | None  # a fault kind, or None for all faults / the run
    metric: str
    stat: str | None  # None: a run metric
    op: str
    threshold: float

    def holds(self, value: float | None) -> bool:
        """No data never passes: a check that cannot fail is no check."""
        if value is None or math.isnan(value):
            return False
        return _OPS[self.op](value, self.threshold)


def parse_check(text: str, *, faults: Mapping[str, str]) -> Check:
    match = _GRAMMAR.match(text)
    if match is None:
        raise CheckSyntaxError(
            f"check {text!r} does not read as `[fault.]metric[.stat] OP number` "
            f"(OP one of {' '.join(_OPS)}), e.g. `kill-primary.promotion_ms.p99 < 100`"
        )
    parts = match["path"].split(".")
    scope = parts.pop(0) if parts[0] in faults else None
    metric, stat = parts[0], (parts[1] if len(parts) > 1 else None)
    if len(parts) > 2:
        raise CheckSyntaxError(f"check {text!r}: too many parts in {match['path']!r}")
    _check_names(text, scope, metric, stat, faults)
    if stat is None and (scope is not None or metric not in RUN_METRICS):
        stat = "sum" if metric in COUNT_METRICS else "max"
    return Check(text, scope, metric, stat, match["op"], float(match["num"]))


def _check_names(
    text: str, scope: str | None, metric: str, stat: str | None, faults: Mapping[str, str]
) -> None:
    if metric not in TRIAL_METRICS and metric not in RUN_METRICS:
        raise CheckSyntaxError(
            f"check {text!r}: unknown metric {metric!r}; valid metrics: "
            f"{', '.join(sorted(set(TRIAL_METRICS) | set(RUN_METRICS)))}; "
            f"valid fault scopes: {', '.join(faults)}"
        )
    if stat is not None and stat not in STATS:
        raise CheckSyntaxError(
            f"check {text!r}: unknown statistic {stat!r}; valid: {', '.join(STATS)}"
        )
    if stat is not None and metric not in TRIAL_METRICS:
        raise CheckSyntaxError(
            f"check {text!r}: {metric!r} is a whole-run figure and takes no statistic"
        )
    if scope is not None and metric not in TRIAL_METRICS:
        raise CheckSyntaxError(
            f"check {text!r}: {metric!r} is a whole-run figure; per-fault metrics: "
            f"{', '.join(TRIAL_METRICS)}"
        )
