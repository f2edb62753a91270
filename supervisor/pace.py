"""Whether a missed heartbeat is the engine's doing: the supervisor's own pace, and what
the kernel says an engine's threads are doing.

On a busy machine a heartbeat can be late for two reasons that are not a hang: the
supervisor itself was descheduled or blocked (its event loop did not run, so heartbeats
waited unread), or the engine was waiting for a CPU. `LoopPace` measures the first: a
task wakes every `period_s`, and a wake (or any `observe`) later than that by more than
`tolerance_s` is a stall of the loop. Time the supervisor was stalled does not count as
an asleep engine's silence. `sched_state` answers the second from `/proc`: an engine
whose threads are stopped (SIGSTOP) while its heartbeat is overdue is hung at once, one
whose threads all sleep once the supervisor's stalls are taken out; one with a thread
runnable is waiting for a CPU (or running) and gets more time
(`heartbeat.busy_silence_ms`). A process whose threads all sleep at the look may still
have sent a heartbeat that is on its way (queued behind the supervisor's own threads), or
be waiting for the GIL after a wake-up: `runs` counts how often a thread was given a CPU
(schedstat), so the supervisor can tell an engine whose heartbeat thread ran since its
last heartbeat (busy, not hung) from one that has not run at all (hung). The decision
itself is `decisions.judge_silence`.
"""

from __future__ import annotations

import asyncio
import collections
import os
import time
from collections.abc import Iterable
from typing import Literal

SchedState = Literal["stopped", "runnable", "sleeping", "gone"]


class LoopPace:
    """The supervisor's own stalls over the last `keep_s` seconds."""

    def __init__(self, period_s: float, tolerance_s: float, keep_s: float) -> None:
        if period_s <= 0 or tolerance_s < 0 or keep_s <= 0:
            raise ValueError("period_s and keep_s must be > 0, tolerance_s >= 0")
        self.period_s, self.tolerance_s, self.keep_s = period_s, tolerance_s, keep_s
        self._last = time.monotonic()
        self._stalls: collections.deque[tuple[float, float]] = collections.deque()
        self.stalls = 0  # how many, since start
        self.max_stall_s = 0.0

    def observe(self, now: float) -> None:
        """The loop runs at `now`: a gap since the last look longer than the period (and
        the tolerance) was a stall. The ticker calls it, and anything that judges
        silences calls it first (it may run before the ticker after a stall)."""
        gap = now - self._last - self.period_s
        if gap > self.tolerance_s:
            self._note(now - gap, now)
        self._last = max(self._last, now)

    def _note(self, start: float, end: float) -> None:
        self._stalls.append((start, end))
        self.stalls += 1
        self.max_stall_s = max(self.max_stall_s, end - start)
        while self._stalls and self._stalls[0][1] < end - self.keep_s:
            self._stalls.popleft()

    def stalled_s(self, since: float, now: float) -> float:
        """How much of (since, now] the supervisor was stalled (overlaps counted once)."""
        return stalled_within(self._stalls, since, now)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            self.observe(time.monotonic())


def stalled_within(stalls: Iterable[tuple[float, float]], since: float, now: float) -> float:
    """The length of the union of `stalls` (start, end) clipped to (since, now]."""
    total, reach = 0.0, since
    for start, end in sorted(stalls):
        start, end = max(start, reach), min(end, now)
        if end > start:
            total += end - start
            reach = end
    return total


def thread_states(pid: int) -> list[str]:
    """The state letter of each thread of `pid` (field 3 of /proc/<pid>/task/*/stat);
    empty when the process is gone."""
    states: list[str] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return states
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # that thread ended meanwhile
        states.append(stat[stat.rindex(b")") + 2 :][:1].decode())
    return states


def sched_state(pids: Iterable[int]) -> SchedState:
    """What the kernel says the processes `pids` (one engine's ranks) are doing: stopped
    if any thread is stopped or traced, else runnable if any thread is running, waiting
    for a CPU or in an uninterruptible wait (paging, a driver call), else sleeping; gone
    when none exists."""
    states = [s for pid in pids for s in thread_states(pid)]
    if not states:
        return "gone"
    if any(s in "Tt" for s in states):
        return "stopped"
    if any(s in "RD" for s in states):
        return "runnable"
    return "sleeping"


def thread_runs(pid: int, tid: int) -> int | None:
    """How many times thread `tid` of `pid` was given a CPU (field 3 of
    /proc/<pid>/task/<tid>/schedstat); None when it is gone or unknown (tid 0)."""
    if tid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
            return int(f.read().split()[2])
    except (OSError, IndexError, ValueError):
        return None


def runs(pids: Iterable[int]) -> int:
    """How many times, in all, the threads of `pids` were given a CPU (0 when all are gone)."""
    total = 0
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            total += thread_runs(pid, int(tid)) or 0
    return total
