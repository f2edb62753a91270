"""A heartbeat late because the machine is busy is not a hang.

Tables for the decision (`decisions.liveness` with the supervisor's own stalls taken out,
`decisions.judge_silence` by what the engine's threads do) and for `pace`'s bookkeeping;
`pace.sched_state` on real processes (stopped, spinning, asleep, gone); then a real
supervisor with echo engines: stopped itself for longer than the miss window, and with
a standby starved of CPU past it, fences nothing, and a stopped primary is still fenced
and replaced.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.backoff import RestartBook
from supervisor.decisions import Fence, Overdue, Windows, daemon_hung, judge_silence, liveness
from supervisor.pace import (
    LoopPace,
    runs,
    sched_state,
    stalled_within,
    thread_runs,
    thread_states,
)
from supervisor.policy import RestartSpec
from supervisor.states import EngineState
from supervisor.units import Engine, Incarnation
from tests.engines.harness import Supervisor, get, topic, write_policy
from tests.realtime_probe import realtime_allowed
from tests.supervisor_fakes import FakeProc

E = EngineState
HANG = 0.2
W = Windows(
    ready_timeout_s=10.0, hang_s=HANG, starting_silence_s=5.0, busy_silence_s=2.0, recheck_s=0.025
)


def ready_engine(beat: float) -> Engine:
    return Engine(
        name="e1",
        group="serving",
        role="standby",
        book=RestartBook(RestartSpec()),
        state=E.STANDBY,
        inc=Incarnation([FakeProc()], started=0.0, hello=True, ready=True),
        last_beat=beat,
    )


# ---- liveness: overdue or not, and how much of it the supervisor was stalled ----
@pytest.mark.parametrize(
    ("now", "stalled", "expected"),
    [
        (1.2, 0.0, 1.0 + HANG + 0.001),  # at the window's edge: not yet
        (1.21, 0.0, Overdue(1.21 - 1.0, HANG, 0.0)),
        (1.5, 0.3, Overdue(1.5 - 1.0, HANG, 0.3)),  # the supervisor was stopped 300 ms of it
        (1.21, 5.0, Overdue(1.21 - 1.0, HANG, 1.21 - 1.0)),  # never more than the silence
    ],
    ids=["edge", "overdue", "stalled-supervisor", "stall-capped"],
)
def test_liveness_overdue(now: float, stalled: float, expected: object) -> None:
    assert liveness(ready_engine(1.0), now, W, None, stalled) == expected


def test_a_missed_beat_gets_a_look_before_the_window_ends() -> None:
    w = Windows(
        ready_timeout_s=10.0,
        hang_s=HANG,
        starting_silence_s=5.0,
        busy_silence_s=2.0,
        recheck_s=0.025,
        look_s=0.075,
    )
    assert liveness(ready_engine(1.0), 1.07, w, None) == pytest.approx(1.076)
    late = liveness(ready_engine(1.0), 1.08, w, None)
    assert isinstance(late, Overdue)
    assert (late.silent_s, late.window_s) == (pytest.approx(0.08), HANG)


# ---- judge_silence: stopped is a hang at the first look; asleep past the window (less
# the supervisor's own stalls) with its heartbeat thread not run since its last heartbeat
# is a hang; runnable, or its heartbeat thread run since, is a busy machine, up to
# busy_silence_s ----
NOW = 10.0
MS = "no heartbeat for"


@pytest.mark.parametrize(
    ("overdue", "sched", "ran", "expected"),
    [
        # a missed beat (75 ms) and the process stopped: fenced without waiting the window
        (
            Overdue(0.075, HANG, 0.0),
            "stopped",
            None,
            Fence("hang", f"{MS} 75.0 ms, its processes stopped"),
        ),
        # a stopped engine never beats again, however long the supervisor was stalled
        (
            Overdue(0.5, HANG, 0.4),
            "stopped",
            True,
            Fence("hang", f"{MS} 500.0 ms, its processes stopped"),
        ),
        (
            Overdue(0.21, HANG, 0.0),
            "gone",
            None,
            Fence("hang", f"{MS} 210.0 ms, its processes gone"),
        ),
        # inside its window: looked at again every recheck_s, at the latest its window's end
        (Overdue(0.075, HANG, 0.0), "sleeping", False, NOW + W.recheck_s),
        (Overdue(0.19, HANG, 0.0), "sleeping", False, NOW + HANG - 0.19 + 0.001),
        (
            Overdue(0.21, HANG, 0.0),
            "sleeping",
            False,
            Fence("hang", f"{MS} 210.0 ms, its processes sleeping"),
        ),
        # an agent that does not name its heartbeat thread: asleep is a hang, as before
        (
            Overdue(0.21, HANG, 0.0),
            "sleeping",
            None,
            Fence("hang", f"{MS} 210.0 ms, its processes sleeping"),
        ),
        # asleep, but its heartbeat thread ran since its last heartbeat: one is on its way,
        # or it waits for the GIL
        (Overdue(0.21, HANG, 0.0), "sleeping", True, NOW + W.recheck_s),
        (
            Overdue(2.01, HANG, 0.0),
            "sleeping",
            True,
            Fence(
                "hang",
                f"{MS} 2010.0 ms though its heartbeat thread ran "
                "(over heartbeat.busy_silence_ms=2000)",
            ),
        ),
        # asleep, but the supervisor was stalled 400 of the 500 ms: 100 ms heard
        (Overdue(0.5, HANG, 0.4), "sleeping", False, NOW + W.recheck_s),
        (
            Overdue(0.5, HANG, 0.2),
            "sleeping",
            False,
            Fence(
                "hang",
                f"{MS} 500.0 ms, its processes sleeping; the supervisor was stalled 200.0 ms of it",
            ),
        ),
        (Overdue(0.21, HANG, 0.0), "runnable", False, NOW + W.recheck_s),  # waiting for a CPU
        (Overdue(2.0, HANG, 0.0), "runnable", None, NOW + W.recheck_s),  # up to busy_silence_s
        (
            Overdue(2.01, HANG, 0.0),
            "runnable",
            None,
            Fence("hang", f"{MS} 2010.0 ms though runnable (over heartbeat.busy_silence_ms=2000)"),
        ),
        (Overdue(2.5, HANG, 0.6), "runnable", None, NOW + W.recheck_s),  # 1.9 s heard
    ],
    ids=[
        "stopped-at-first-miss",
        "stopped-while-stalled",
        "gone",
        "sleeping-in-window",
        "sleeping-window-end",
        "sleeping",
        "sleeping-thread-unknown",
        "sleeping-thread-ran",
        "sleeping-thread-ran-too-long",
        "sleeping-while-stalled",
        "sleeping-past-the-stall",
        "runnable",
        "runnable-edge",
        "runnable-too-long",
        "runnable-while-stalled",
    ],
)
def test_judge_silence(overdue: Overdue, sched: Any, ran: bool | None, expected: object) -> None:
    got = judge_silence(overdue, sched, NOW, W, ran)
    assert got == (pytest.approx(expected) if isinstance(expected, float) else expected)


@pytest.mark.parametrize(
    ("silent", "stalled", "sched", "ran", "expected"),
    [
        (0.5, 0.0, "stopped", False, "no answer for 500.0 ms, its process stopped"),
        (0.5, 0.0, "gone", False, None),  # its exit is the watch's
        (0.5, 0.0, "sleeping", False, "no answer for 500.0 ms, its process sleeping"),
        (0.6, 0.2, "sleeping", False, None),  # 400 ms heard
        (0.5, 0.0, "sleeping", True, None),  # it ran since the first unanswered ping
        (0.5, 0.0, "runnable", False, None),
        (2.0, 0.0, "runnable", False, "no answer for 2000.0 ms though runnable"),
        (2.0, 0.0, "sleeping", True, "no answer for 2000.0 ms though it ran"),
    ],
    ids=["stopped", "gone", "asleep", "stalled", "ran", "runnable", "runnable-long", "ran-long"],
)
def test_daemon_hung(
    silent: float, stalled: float, sched: Any, ran: bool, expected: str | None
) -> None:
    assert daemon_hung(silent, stalled, sched, ran, deadline_s=0.5, busy_s=2.0) == expected


def test_a_starting_engine_that_is_busy_keeps_its_longer_window() -> None:
    w = Windows(
        ready_timeout_s=10.0, hang_s=HANG, starting_silence_s=5.0, busy_silence_s=1.0, recheck_s=0.1
    )
    assert judge_silence(Overdue(3.0, 5.0, 0.0), "runnable", 0.0, w) == 0.1


# ---- pace: stalls of the supervisor's own loop ----
@pytest.mark.parametrize(
    ("stalls", "since", "now", "expected"),
    [
        ([], 0.0, 10.0, 0.0),
        ([(1.0, 2.0)], 0.0, 10.0, 1.0),
        ([(1.0, 2.0)], 1.5, 10.0, 0.5),  # clipped at `since`
        ([(1.0, 2.0)], 0.0, 1.25, 0.25),  # and at `now`
        ([(1.0, 2.0), (1.5, 3.0)], 0.0, 10.0, 2.0),  # overlaps counted once
        ([(4.0, 5.0), (1.0, 2.0)], 0.0, 10.0, 2.0),  # in any order
        ([(1.0, 2.0)], 2.0, 10.0, 0.0),  # before the silence began
    ],
)
def test_stalled_within(
    stalls: list[tuple[float, float]], since: float, now: float, expected: float
) -> None:
    assert stalled_within(stalls, since, now) == pytest.approx(expected)


def test_loop_pace_counts_late_wakes() -> None:
    pace = LoopPace(period_s=0.01, tolerance_s=0.01, keep_s=5.0)
    t = pace._last  # the clock of its construction
    pace.observe(t + 0.015)  # 5 ms late: within the tolerance
    pace.observe(t + 0.335)  # 310 ms late: a stall
    pace.observe(t + 0.34)  # and on time again
    assert pace.stalled_s(t, t + 1.0) == pytest.approx(0.31)
    assert pace.stalled_s(t + 0.3, t + 1.0) == pytest.approx(0.035)
    assert (pace.stalls, round(pace.max_stall_s, 3)) == (1, 0.31)
    pace.observe(t + 9.0)  # a new stall, 8.65 s long; the first, older than keep_s, is gone
    assert pace.stalled_s(t, t + 0.34) == 0.0
    assert pace.stalled_s(t, t + 9.0) == pytest.approx(9.0 - 0.34 - 0.01)


# ---- sched_state on real processes ----
def child(code: str) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline() == "up\n"
    return p


def end(p: subprocess.Popen[str]) -> None:
    p.kill()
    p.wait()
    if p.stdout is not None:
        p.stdout.close()


@pytest.fixture
def spinner() -> Iterator[subprocess.Popen[str]]:
    p = child("print('up', flush=True)\nwhile True: pass")
    yield p
    end(p)


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[str]]:
    p = child("import time; print('up', flush=True); time.sleep(600)")
    yield p
    end(p)


def test_a_spinning_process_is_runnable(spinner: subprocess.Popen[str]) -> None:
    assert sched_state([spinner.pid]) == "runnable"


def test_a_stopped_process_is_stopped(spinner: subprocess.Popen[str]) -> None:
    os.kill(spinner.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10  # the stop is delivered once it is on a CPU
    while "R" in thread_states(spinner.pid) and time.monotonic() < deadline:
        os.sched_yield()
    assert sched_state([spinner.pid]) == "stopped"


def test_stopped_wins_over_a_runnable_rank(
    spinner: subprocess.Popen[str], sleeper: subprocess.Popen[str]
) -> None:
    os.kill(sleeper.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    # a thread that was runnable when signalled stops once it gets a CPU
    while "T" not in thread_states(sleeper.pid) and time.monotonic() < deadline:
        os.sched_yield()
    assert sched_state([spinner.pid, sleeper.pid]) == "stopped"


def test_a_sleeping_process_is_sleeping(sleeper: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 10  # it may still be on its way into the sleep
    while sched_state([sleeper.pid]) != "sleeping" and time.monotonic() < deadline:
        os.sched_yield()
    assert sched_state([sleeper.pid]) == "sleeping"


def test_runs_counts_a_thread_given_a_cpu_and_not_one_asleep(
    sleeper: subprocess.Popen[str],
) -> None:
    tid = threading.get_native_id()
    before = thread_runs(os.getpid(), tid)
    assert before is not None
    for _ in range(3):
        time.sleep(0.001)  # each wake-up puts this thread on a CPU again
    after = thread_runs(os.getpid(), tid)
    assert after is not None and after > before
    deadline = time.monotonic() + 10
    while sched_state([sleeper.pid]) != "sleeping" and time.monotonic() < deadline:
        time.sleep(0.01)  # until it is in its sleep
    asleep = runs([sleeper.pid])
    assert asleep > 0  # it ran to get to its sleep
    for _ in range(3):
        os.sched_yield()
    assert runs([sleeper.pid]) == asleep  # asleep for 600 s: given no CPU since
    assert thread_runs(os.getpid(), 0) is None  # a thread never named


def test_a_reaped_process_is_gone() -> None:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert sched_state([p.pid]) == "gone" and thread_states(p.pid) == []


# ---- a real supervisor on a busy machine ----
INTERVAL_MS, MISSES = 50, 4
WINDOW_S = INTERVAL_MS * MISSES / 1000


@pytest.fixture
def sup(tmp_path: Path, tiny_model: Path) -> Iterator[Supervisor]:
    policy = write_policy(
        tmp_path / "policy.yaml",
        tiny_model,
        tmp_path / "run",
        # a starved engine is never fenced for being runnable within this test
        heartbeat={"interval_ms": INTERVAL_MS, "miss_limit": MISSES, "busy_silence_ms": 600000},
        restart={"initial_s": 0.05, "max_s": 0.1},
    )
    s = Supervisor(policy)
    try:
        s.wait_pair()
        yield s
    finally:
        s.stop(signal.SIGKILL if s.proc.poll() is None else signal.SIGTERM)


def engines(sup: Supervisor) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in get(f"{sup.api}/cluster")[1]["engines"]}


def until_all_heard(sup: Supervisor, pids: dict[str, int], since: float, timeout: float) -> None:
    """Until each engine in `pids`, that same process, was heard from after `since`
    (monotonic): a fenced one never is."""
    deadline = time.monotonic() + timeout
    while True:
        now = time.monotonic()
        view = engines(sup)
        heard = all(
            view[n]["pid"] == pid
            and view[n]["heartbeat_age_ms"] is not None
            and now - view[n]["heartbeat_age_ms"] / 1000 > since
            for n, pid in pids.items()
        )
        if heard:
            return
        assert now < deadline, f"not all of {pids} heard from again within {timeout} s: {view}"
        time.sleep(INTERVAL_MS / 1000)  # the next heartbeat, at the earliest


def no_fences(sup: Supervisor, mark: int) -> list[str]:
    return [
        e.topic for e in sup.tap.events[mark:] if e.event in ("fenced", "died", "promoted", "hung")
    ]


def steady(sup: Supervisor) -> dict[str, int]:
    """Until the pool is a primary and a ready standby; their pids."""
    deadline = time.monotonic() + 60
    while True:
        mark = sup.tap.mark()
        view = engines(sup)
        if sorted(e["state"] for e in view.values()) == ["primary", "standby"]:
            return {n: e["pid"] for n, e in view.items()}
        assert time.monotonic() < deadline, f"no primary and standby within 60 s: {view}"
        sup.wait(lambda e: e.event in ("ready", "promoted"), timeout=60, after=mark)


def test_a_supervisor_stopped_past_the_miss_window_fences_nothing(sup: Supervisor) -> None:
    pids = steady(sup)
    mark = sup.tap.mark()
    os.kill(sup.proc.pid, signal.SIGSTOP)
    try:
        # the engines beat on and nobody reads them, for twice the miss window (and less
        # than the cache daemon's ping deadline, 0.5 s)
        time.sleep(2 * WINDOW_S)
    finally:
        os.kill(sup.proc.pid, signal.SIGCONT)
    resumed = time.monotonic()
    until_all_heard(sup, pids, resumed, timeout=30)
    assert no_fences(sup, mark) == []
    assert {n: e["pid"] for n, e in engines(sup).items()} == pids


@pytest.mark.skipif(not realtime_allowed(), reason="starving a process needs SCHED_FIFO")
def test_a_standby_starved_of_cpu_past_the_miss_window_is_not_fenced(sup: Supervisor) -> None:
    pids = steady(sup)
    standby = next(n for n, e in engines(sup).items() if e["state"] == "standby")
    mark = sup.tap.mark()
    with Starved(pids[standby]):  # runnable all along, and on no CPU
        deadline = time.monotonic() + 60
        while (engines(sup)[standby]["heartbeat_age_ms"] or 0) < 2 * WINDOW_S * 1000:
            assert time.monotonic() < deadline, "the starved standby kept beating"
            time.sleep(INTERVAL_MS / 1000)
    until_all_heard(sup, pids, time.monotonic(), timeout=30)
    assert no_fences(sup, mark) == []
    assert engines(sup)[standby]["pid"] == pids[standby]


def test_a_stopped_primary_is_fenced_at_its_first_missed_beat(sup: Supervisor) -> None:
    steady(sup)
    old = get(f"{sup.api}/primary")[1]
    mark = sup.tap.mark()
    os.kill(old["pid"], signal.SIGSTOP)
    fenced = sup.wait(topic(f"engine.{old['name']}.fenced"), timeout=10, after=mark)
    promoted = sup.wait(lambda e: e.event == "promoted", timeout=10, after=mark)
    assert fenced.data["cause"] == "hang" and "its processes stopped" in fenced.data["detail"]
    assert promoted.name != old["name"] and promoted.data["cause"] == "hang"
    # looked at once a beat is missed (1.5 intervals late), not only once the window ends
    assert promoted.data["silent_ms"] > INTERVAL_MS * 1.5


class Starved:
    """Every thread of `pid` on CPU 0, beside a busy loop that runs there as SCHED_FIFO:
    runnable all along and (RT throttling aside, which leaves normal tasks 5% of each
    second) on no CPU, until the block ends. The loop ends itself after `limit_s`, should
    the test not get to end it."""

    def __init__(self, pid: int, limit_s: float = 30.0) -> None:
        self.pid, self.limit_s = pid, limit_s
        self.spinner: subprocess.Popen[str] | None = None

    def _threads(self) -> list[int]:
        return [int(t) for t in os.listdir(f"/proc/{self.pid}/task")]

    def __enter__(self) -> Starved:
        for tid in self._threads():
            os.sched_setaffinity(tid, {0})
        self.spinner = child(
            "import os, time\n"
            "os.sched_setaffinity(0, {0})\n"
            "os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))\n"
            f"end = time.monotonic() + {self.limit_s}\n"
            "print('up', flush=True)\n"
            "while time.monotonic() < end: pass"
        )
        return self

    def __exit__(self, *exc: object) -> None:
        if self.spinner is not None:
            end(self.spinner)
        for tid in self._threads():
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(tid, range(os.cpu_count() or 1))
