"""Figures from the response log: failover times, failed requests, and the overlap of two
cluster epochs.

Overlap. A response of cluster epoch E was answered by E's leader at some moment inside
[sent, answered] of that request; nothing narrower is known from the client. Two leaders
certainly served at once when a response of an older epoch was *sent* after a response of
a newer epoch had already been *answered*: the old leader answered it later than the new
one answered. `overlap_ms` is the largest such gap over every pair of epochs (0: never).
The hull [first sent, last answered] of each epoch is not used: a request held by a router
across a leader change (retry before the first byte) is sent under the old leader and
answered by the new one, which says nothing about two leaders serving.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence

from chaos.fleet.load import Row


def overlap_ms(rows: Iterable[Row]) -> float:
    first_answered: dict[int, float] = {}
    last_sent: dict[int, float] = {}
    for row in rows:
        if not row.ok or row.cluster_epoch <= 0:
            continue
        e = row.cluster_epoch
        first_answered[e] = min(first_answered.get(e, row.answered), row.answered)
        last_sent[e] = max(last_sent.get(e, row.sent), row.sent)
    worst = 0.0
    for old, sent in last_sent.items():
        for new, answered in first_answered.items():
            if new > old:
                worst = max(worst, sent - answered)
    return round(worst * 1000.0, 3)


def epoch_nodes(rows: Iterable[Row]) -> dict[int, set[str]]:
    """The nodes that answered under each cluster epoch (one each, in a sound fleet)."""
    out: dict[int, set[str]] = defaultdict(set)
    for row in rows:
        if row.ok:
            out[row.cluster_epoch].add(row.node)
    return dict(out)


def failed(rows: Iterable[Row], routers: set[str] | None = None) -> list[Row]:
    """Failed rows of clients of `routers` (None: every router)."""
    return [r for r in rows if not r.ok and (routers is None or r.router in routers)]


def ms(since: float, at: float | None) -> float | None:
    return None if at is None else round((at - since) * 1000.0, 2)


def summary(values: Sequence[float | None]) -> dict[str, float | int | None]:
    """count, p50, p99, max of the measured values (None: not measured, counted apart)."""
    data = sorted(v for v in values if v is not None)
    out: dict[str, float | int | None] = {"count": len(data), "missing": len(values) - len(data)}
    for name, q in (("p50", 0.50), ("p99", 0.99)):
        out[name] = _rank(data, q)
    out["max"] = data[-1] if data else None
    out["min"] = data[0] if data else None
    return out


def _rank(data: list[float], q: float) -> float | None:
    """Nearest-rank percentile (the chaos suite's rule): with 30 values p99 is the max."""
    if not data:
        return None
    return data[max(math.ceil(q * len(data)), 1) - 1]
