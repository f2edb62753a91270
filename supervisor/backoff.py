"""Restart backoff and restart intensity.

`Backoff` is the wait before retry number n: initial * base**(n-1), capped, plus up to
`jitter` seconds at random (tenacity's `wait_exponential + wait_random`, computed directly).
`RestartBook` keeps one unit's restart times: `delay()` is the wait before the next start,
and `record()` says whether the unit has now restarted more than `max_restarts` times
within `window_s` and must be quarantined.
"""

from __future__ import annotations

import collections
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from supervisor.policy import RestartSpec


@dataclass(frozen=True)
class Backoff:
    initial: float
    cap: float
    base: float
    jitter: float

    def delay(self, attempt: int, rand: Callable[[], float] = random.random) -> float:
        """The wait before retry number `attempt` (1-based; 0 counts as 1)."""
        try:
            grown = self.initial * self.base ** (max(1, attempt) - 1)
        except OverflowError:
            grown = self.cap
        return max(0.0, min(grown, self.cap)) + rand() * self.jitter


def backoff_wait(initial: float, cap: float, base: float, jitter: float) -> Backoff:
    """initial * base**(n-1), capped at `cap`, plus up to `jitter` seconds at random."""
    return Backoff(initial, cap, base, jitter)


def delay_for(wait: Backoff, attempt: int) -> float:
    """The wait `wait` gives for retry number `attempt` (1-based)."""
    return wait.delay(attempt)


class RestartBook:
    def __init__(self, spec: RestartSpec, rand: Callable[[], float] = random.random) -> None:
        self.spec = spec
        self.times: collections.deque[float] = collections.deque()
        self.total = 0
        self._wait = Backoff(spec.initial_s, spec.max_s, spec.multiplier, spec.jitter_s)
        self._rand = rand

    def recent(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        while self.times and now - self.times[0] > self.spec.window_s:
            self.times.popleft()
        return len(self.times)

    def record(self, now: float | None = None) -> bool:
        """Count one restart; True when this one exceeds the intensity limit."""
        now = time.monotonic() if now is None else now
        self.times.append(now)
        self.total += 1
        return self.recent(now) > self.spec.max_restarts

    def delay(self, now: float | None = None) -> float:
        return self._wait.delay(self.recent(now), self._rand)

    def reset(self) -> None:
        self.times.clear()
