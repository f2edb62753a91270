"""The promotion's real-time stretch (supervisor.realtime), on this machine's scheduler."""

from __future__ import annotations

import asyncio
import os
import resource
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest
import structlog

from supervisor.exitwatch import ExitWatch
from supervisor.realtime import RealtimeSection
from tests.as_user import as_user
from tests.realtime_probe import realtime_allowed

NOBODY = 65534


def on_a_thread(work: Callable[[], Any]) -> Any:
    """`work` on a thread of its own, so a policy it sets never stays on pytest's."""
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(work()))
    t.start()
    t.join()
    return out[0]


needs_rt = pytest.mark.skipif(not realtime_allowed(), reason="SCHED_FIFO is not allowed here")


@needs_rt
def test_enter_is_fifo_and_leave_is_normal_again() -> None:
    def work() -> list[int]:
        rt = RealtimeSection(True)
        seen = [os.sched_getscheduler(0)]
        rt.enter()
        seen += [os.sched_getscheduler(0), os.sched_getparam(0).sched_priority, int(rt.held)]
        rt.enter()  # (a second enter changes nothing)
        rt.leave()
        seen += [os.sched_getscheduler(0), int(rt.held)]
        rt.leave()  # (nor a second leave)
        seen += [os.sched_getscheduler(0)]
        return seen

    fifo = os.SCHED_FIFO | os.SCHED_RESET_ON_FORK
    assert on_a_thread(work) == [os.SCHED_OTHER, fifo, 1, 1, os.SCHED_OTHER, 0, os.SCHED_OTHER]


@needs_rt
def test_a_child_started_inside_runs_at_normal_priority() -> None:
    def work() -> str:
        rt = RealtimeSection(True)
        rt.enter()
        try:
            out = subprocess.run(
                [sys.executable, "-c", "import os; print(os.sched_getscheduler(0))"],
                capture_output=True,
                text=True,
                check=True,
            )
        finally:
            rt.leave()
        return out.stdout.strip()

    assert on_a_thread(work) == str(os.SCHED_OTHER)


def test_switched_off_by_the_policy_it_does_nothing() -> None:
    def work() -> tuple[bool, int, bool]:
        rt = RealtimeSection(False)
        rt.enter()
        try:
            return rt.enabled, os.sched_getscheduler(0), rt.held
        finally:
            rt.leave()

    assert on_a_thread(work) == (False, os.SCHED_OTHER, False)


def test_a_thread_started_under_another_policy_is_left_as_it_is() -> None:
    def work() -> tuple[bool, int]:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        rt = RealtimeSection(True)
        rt.enter()
        policy = os.sched_getscheduler(0)
        rt.leave()
        return rt.enabled, policy

    assert on_a_thread(work) == (False, os.SCHED_BATCH)


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root")
def test_without_the_right_it_says_so_once_at_start_and_promotes_as_before() -> None:
    def work() -> list[Any]:
        resource.setrlimit(resource.RLIMIT_RTPRIO, (0, 0))
        with structlog.testing.capture_logs() as logs:
            rt = RealtimeSection(True)
            rt.enter()
            policy = os.sched_getscheduler(0)
            rt.leave()
        return [rt.enabled, policy, [entry["event"] for entry in logs]]

    enabled, policy, events = as_user(NOBODY, work)
    assert (enabled, policy) == (False, os.SCHED_OTHER)
    assert len(events) == 1 and "SCHED_FIFO needs root, CAP_SYS_NICE" in events[0]
    assert "heartbeat.realtime_promotion: false" in events[0]


@needs_rt
def test_the_exit_watch_looks_inside_the_section_and_leaves_it_between_looks() -> None:
    """Each look runs as SCHED_FIFO, so the switch is made before an exit is seen, not in
    the response to it; the callback starts inside; between looks the thread is normal
    again, and after a callback that did not leave the section itself."""
    policies: dict[str, int] = {}

    class Counted(ExitWatch):
        """An exit watch that says how it ran each look, and when five have been made."""

        looks: list[int] = []
        five = asyncio.Event()

        def poll(self) -> int | None:
            self.looks.append(os.sched_getscheduler(0))
            if len(self.looks) == 5:
                self.five.set()
            return super().poll()

    async def watch() -> None:
        rt = RealtimeSection(True)
        seen = asyncio.Event()

        def on_exiting(key: str, pid: int) -> None:
            policies["callback"] = os.sched_getscheduler(0)
            seen.set()

        watcher = Counted(0.002, on_exiting, rt)
        child = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
        try:
            watcher.watch("primary", [child.pid])
            await watcher.five.wait()  # five looks that saw nothing
            policies["between"] = os.sched_getscheduler(0)
            child.kill()
            await asyncio.wait_for(seen.wait(), 60)
            policies["after"] = os.sched_getscheduler(0)  # (the watch's finally has run)
        finally:
            child.kill()
            child.wait()
            await watcher.close()

    on_a_thread(lambda: asyncio.run(watch()))
    fifo = os.SCHED_FIFO | os.SCHED_RESET_ON_FORK
    assert set(Counted.looks) == {fifo}  # every look, the one that saw the exit too
    assert policies == {"between": os.SCHED_OTHER, "callback": fifo, "after": os.SCHED_OTHER}
