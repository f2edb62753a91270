"""Restart backoff (tenacity's wait functions) and restart intensity.

`RestartBook` keeps one unit's restart times: `delay()` is the wait before the next start
(exponential with jitter), and `record()` says whether the unit has now restarted more than
`max_restarts` times within `window_s` and must be quarantined.
"""

from __future__ import annotations

import collections
import time
from typing import Any

from tenacity import RetryCallState, Retrying, wait_exponential, wait_random

from supervisor.policy import RestartSpec


def backoff_wait(initial: float, cap: float, base: float, jitter: float) -> Any:
    """initial * base**(n-1), capped at `cap`, plus up to `jitter` seconds at random."""
    return wait_exponential(multiplier=initial, max=cap, exp_base=base) + wait_random(0, jitter)


def delay_for(wait: Any, attempt: int) -> float:
    """What tenacity's `wait` gives for retry number `attempt` (1-based)."""
    state = RetryCallState(Retrying(), None, (), {})
    state.attempt_number = max(1, attempt)
    return float(wait(state))


class RestartBook:
    def __init__(self, spec: RestartSpec) -> None:
        self.spec = spec
        self.times: collections.deque[float] = collections.deque()
        self.total = 0
        self._wait = backoff_wait(spec.initial_s, spec.max_s, spec.multiplier, spec.jitter_s)

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
        return delay_for(self._wait, self.recent(now))

    def reset(self) -> None:
        self.times.clear()
