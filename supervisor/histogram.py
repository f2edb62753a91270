"""A histogram as Prometheus exposes one: a count per bucket (not cumulative), the sum of
what was observed, and the cumulative counts by upper bound at scrape time. The
supervisor's state durations (supervisor/metrics.py) and the router's stream stalls
(supervisor/proxy/routing.py `Tally`) are each one."""

from __future__ import annotations

import bisect


class Histogram:
    """Observations into the buckets of `bounds` (upper bounds, ascending) and +Inf."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.buckets = [0] * (len(bounds) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.buckets[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, float]]:
        edges = [*(f"{b:g}" for b in self.bounds), "+Inf"]
        running, out = 0, []
        for edge, n in zip(edges, self.buckets, strict=True):
            running += n
            out.append((edge, float(running)))
        return out
