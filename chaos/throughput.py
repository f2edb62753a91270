"""Throughput: requests/s and output tokens/s before the first fault (the baseline) and
inside the trials of each fault kind, and how far each fell from the baseline."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from chaos.load import RequestRow
from chaos.metrics import StageSpan, TrialRow


class Rate(msgspec.Struct, frozen=True):
    label: str  # "before the first fault", or a fault kind
    seconds: float
    requests_per_s: float
    tokens_per_s: float
    drop_pct: float | None = None  # of tokens/s against the baseline (requests/s without tokens)


def _rate(label: str, rows: Sequence[RequestRow], seconds: float) -> Rate:
    ok = [r for r in rows if r.ok]
    per_s = len(ok) / seconds if seconds > 0 else 0.0
    tokens = sum(r.tokens for r in ok) / seconds if seconds > 0 else 0.0
    return Rate(label, round(seconds, 1), round(per_s, 1), round(tokens, 1))


def baseline(
    rows: Sequence[RequestRow], stages: Sequence[StageSpan], before: float | None
) -> Rate | None:
    """Completed requests between the first stage's load start and the first fault."""
    if not stages or before is None or before <= stages[0].start:
        return None
    start = stages[0].start
    inside = [r for r in rows if start <= r.end < before]
    return _rate("before the first fault", inside, before - start)


def per_fault(
    rows: Sequence[RequestRow], trials: Sequence[TrialRow], base: Rate | None
) -> list[Rate]:
    """Each fault kind's throughput over the time its injected trials lasted."""
    out = []
    for fault in sorted({t.fault for t in trials if t.outcome == "injected"}):
        mine = [t for t in trials if t.fault == fault and t.outcome == "injected"]
        seconds = sum(t.ended - t.injected for t in mine)
        inside = [r for r in rows if any(t.injected <= r.end < t.ended for t in mine)]
        rate = _rate(fault, inside, seconds)
        out.append(msgspec.structs.replace(rate, drop_pct=_drop(rate, base)))
    return out


def _drop(rate: Rate, base: Rate | None) -> float | None:
    if base is None:
        return None
    if base.tokens_per_s > 0:
        return round(100.0 * (1.0 - rate.tokens_per_s / base.tokens_per_s), 1)
    if base.requests_per_s > 0:
        return round(100.0 * (1.0 - rate.requests_per_s / base.requests_per_s), 1)
    return None
