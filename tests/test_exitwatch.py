"""The exit watch sees a real process start to exit, and never mistakes a reused pid."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest

from supervisor.exitwatch import ExitWatch, Look, stat_says_exiting, status_says_killed

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def test_stat_and_status_lines_with_odd_names_and_every_exit_sign() -> None:
    running = b"42 (a) b) c) S 1 42 42 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 1 0 0"
    assert not stat_says_exiting(running)
    assert stat_says_exiting(running.replace(b" S ", b" Z "))
    assert stat_says_exiting(running.replace(b"4194560", str(4194560 | 0x4).encode()))
    status = b"Name:\tx\nSigQ:\t0/1\nSigPnd:\t%016x\nShdPnd:\t%016x\nSigBlk:\t0\n"
    assert not status_says_killed(status % (0, 0))
    assert status_says_killed(status % (0, 0x100))  # SIGKILL pending for the process
    assert status_says_killed(status % (0x100, 0))  # ... or for the thread
    assert not status_says_killed(status % (0, 0x4000))  # SIGTERM: it may be handled


def test_a_running_process_is_not_done_and_a_killed_unreaped_one_is() -> None:
    child = subprocess.Popen(SLEEPER)
    try:
        look = Look(child.pid)
        assert not look.done()
        child.send_signal(signal.SIGKILL)
        assert look.done()  # a zombie until waited for, or SIGKILL pending: done all the same
        child.wait()
        assert look.done()  # reaped: the files still name it, and it is gone
        look.close()
    finally:
        child.kill()
        child.wait()


def test_a_stopped_process_sent_sigkill_is_done_before_it_runs() -> None:
    """SIGSTOPped, then SIGKILLed: until it is on a CPU again it may be neither exiting nor
    a zombie, yet it will run no more user code; the pending SIGKILL says so at once."""
    child = subprocess.Popen(SLEEPER)
    try:
        child.send_signal(signal.SIGSTOP)
        _, status = os.waitpid(child.pid, os.WUNTRACED)  # returns once it has stopped
        assert os.WIFSTOPPED(status)
        look = Look(child.pid)
        assert not look.done()
        os.kill(child.pid, signal.SIGKILL)
        assert look.done()  # at once: no waiting for it to run
        look.close()
    finally:
        child.kill()
        child.wait()


def test_the_watch_reports_the_group_once_then_watches_the_next() -> None:
    async def main() -> list[tuple[str, int]]:
        seen: list[tuple[str, int]] = []
        done = asyncio.Event()
        a, b = subprocess.Popen(SLEEPER), subprocess.Popen(SLEEPER)

        def on_exiting(key: str, pid: int) -> None:
            seen.append((key, pid))
            if key == "first":
                watch.watch("second", [b.pid])
            else:
                done.set()

        watch = ExitWatch(0.002, on_exiting)
        try:
            watch.watch("first", [a.pid])
            assert watch.poll() is None and seen == []  # both alive: nothing to report
            a.kill()
            b.kill()
            await asyncio.wait_for(done.wait(), 10)
        finally:
            await watch.close()
            for p in (a, b):
                p.kill()
                p.wait()
        return seen

    first, second = asyncio.run(main())
    assert first[0] == "first" and second[0] == "second"


def test_a_pid_gone_before_the_watch_starts_is_reported_at_once() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()

    async def main() -> list[int]:
        seen: list[int] = []
        done = asyncio.Event()
        watch = ExitWatch(0.002, lambda _key, pid: (seen.append(pid), done.set()))
        watch.watch("gone", [child.pid])
        await asyncio.wait_for(done.wait(), 10)
        await watch.close()
        return seen

    assert asyncio.run(main()) == [child.pid]


def test_a_bad_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        ExitWatch(0, lambda _k, _p: None)
