"""Throughput: requests/s and output tokens/s before the first fault (the baseline) and
inside the trials of each fault kind, and how far each fell from the baseline.

Requests/s counts the successful requests that ended inside a window. Tokens/s counts the
part of each successful answer's tokens that came inside it, spread evenly over the time
the request took: a long answer (256 tokens over seconds) that ends just after a window
gave most of its tokens inside it, and counting it whole where it ends would step a short
window's figure by whole rounds of answers."""

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


def _rate(label: str, rows: Sequence[RequestRow], windows: Sequence[tuple[float, float]]) -> Rate:
    ok = [r for r in rows if r.ok]
    seconds = sum(b - a for a, b in windows)
    if seconds <= 0:
        return Rate(label, 0.0, 0.0, 0.0)
    ended = sum(1 for r in ok if any(a <= r.end < b for a, b in windows))
    tokens = sum(r.tokens * _share(r, a, b) for r in ok for a, b in windows)
    return Rate(label, round(seconds, 1), round(ended / seconds, 1), round(tokens / seconds, 1))


def _share(row: RequestRow, a: float, b: float) -> float:
    """The part of `row`'s time that lies inside [a, b) (all of it for an instant one that
    ended there)."""
    took = row.end - row.start
    if took <= 0:
        return 1.0 if a <= row.end < b else 0.0
    return max(0.0, min(row.end, b) - max(row.start, a)) / took


def baseline(
    rows: Sequence[RequestRow], stages: Sequence[StageSpan], before: float | None
) -> Rate | None:
    """Between the first stage's load start and the first fault."""
    if not stages or before is None or before <= stages[0].start:
        return None
    return _rate("before the first fault", rows, [(stages[0].start, before)])


def per_fault(
    rows: Sequence[RequestRow], trials: Sequence[TrialRow], base: Rate | None
) -> list[Rate]:
    """Each fault kind's throughput over the time its injected trials lasted."""
    out = []
    for fault in sorted({t.fault for t in trials if t.outcome == "injected"}):
        mine = [t for t in trials if t.fault == fault and t.outcome == "injected"]
        rate = _rate(fault, rows, [(t.injected, t.ended) for t in mine])
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
