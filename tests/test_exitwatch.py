"""The exit watch sees a real process start to exit, and never mistakes a reused pid."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from supervisor.exitwatch import ExitWatch, open_stat, read_exiting, stat_says_exiting

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def test_stat_lines_with_odd_names_and_every_exit_sign() -> None:
    running = b"42 (a) b) c) S 1 42 42 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 1 0 0"
    assert not stat_says_exiting(running)
    assert stat_says_exiting(running.replace(b" S ", b" Z "))
    assert stat_says_exiting(running.replace(b"4194560", str(4194560 | 0x4).encode()))


def test_a_running_process_is_not_exiting_and_a_killed_unreaped_one_is() -> None:
    child = subprocess.Popen(SLEEPER)
    try:
        fd = open_stat(child.pid)
        assert fd is not None and not read_exiting(fd)
        child.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not read_exiting(fd):  # a zombie until waited for: exiting all the same
            assert time.monotonic() < deadline, "a SIGKILLed child never read as exiting"
            time.sleep(0.001)
        child.wait()
        assert read_exiting(fd)  # reaped: the fd still names it, and it is gone
        os.close(fd)
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
            await asyncio.sleep(0.02)
            assert seen == []
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
