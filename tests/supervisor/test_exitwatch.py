"""The exit watch sees a real process start to exit, and never mistakes a reused pid; of a
group's ranks seen done at one look it names the one whose death brought the group down."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest

from engine.peerwatch import EXIT_BROKEN
from supervisor.exitwatch import (
    EXIT_PEER_LOST,
    Death,
    ExitWatch,
    Look,
    Sight,
    first_death,
    stat_exit_code,
    stat_says_exiting,
    status_says_killed,
)

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]
# leaves as a rank whose peer is gone does: once told (a line on stdin), from a thread of
# its own, with the broken group's status
LEAVER = [
    sys.executable,
    "-c",
    "import os, sys, threading\n"
    "t = threading.Thread(target=lambda: (sys.stdin.readline(), os._exit(3)))\n"
    "t.start(); t.join()",
]


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
    tail = b" 0" * 28  # fields 25-52; the last, the exit code, as a wait status
    assert stat_exit_code(running + tail) is None  # not set (yet)
    assert stat_exit_code(running + tail[:-2] + b" 9") == -9  # killed by SIGKILL
    assert stat_exit_code(running + tail[:-2] + b" 768") == 3  # exit(3)
    assert stat_exit_code(running) is None  # a kernel without the field


def test_the_rank_blamed_is_never_one_that_went_because_another_did() -> None:
    killed, peer_lost, ours = Death(1, -9, False), Death(0, EXIT_PEER_LOST, False), True
    assert first_death([Death(0, -9, ours), killed]) == killed  # we killed rank 0 after
    assert first_death([peer_lost, killed]) == killed  # rank 0 left: its peer was gone
    assert first_death([Death(0, None, ours), Death(1, None, False)]).rank == 1
    assert first_death([Death(0, None, False), Death(1, None, False)]).rank == 0  # no clue
    assert first_death([Death(0, -9, ours), Death(1, -9, ours)]).rank == 0
    assert first_death([Death(2, 1, False), killed]).rank == 1
    assert first_death([peer_lost]) == peer_lost  # alone, it is the one
    with pytest.raises(ValueError, match="at least one"):
        first_death([])
    assert killed.detail() == "rank 1 is exiting (killed by signal 9)"
    assert peer_lost.detail() == "rank 0 is exiting (exit status 3)"
    assert Death(0, None, False).detail() == "rank 0 is exiting"
    assert EXIT_PEER_LOST == EXIT_BROKEN  # the status the engine leaves a broken group with


def test_one_look_sees_every_rank_done_and_how_each_ends() -> None:
    """Rank 1 is killed; rank 0 then leaves with the broken group's status: one look sees
    both done, and how each ends, so rank 1 is named although rank 0 comes first."""
    ranks = [subprocess.Popen(LEAVER, stdin=subprocess.PIPE), subprocess.Popen(SLEEPER)]

    async def look() -> list[Sight]:
        watch = ExitWatch(0.002, lambda _k, _s: None)
        watch.watch("group", [p.pid for p in ranks])
        try:
            assert watch.poll() == []  # both run
            ranks[1].kill()
            assert ranks[0].stdin is not None
            ranks[0].stdin.write(b"peer gone\n")
            ranks[0].stdin.close()
            for p in ranks:  # until each has exited, left unreaped (zombies)
                os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)
            return watch.poll()
        finally:
            await watch.close()

    try:
        sights = asyncio.run(look())
    finally:
        for p in ranks:
            p.kill()
            p.wait()
    assert sights == [Sight(ranks[0].pid, EXIT_PEER_LOST), Sight(ranks[1].pid, -9)]
    deaths = [Death(rank, s.code, False) for rank, s in enumerate(sights)]
    assert first_death(deaths).detail() == "rank 1 is exiting (killed by signal 9)"


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
    pids: list[int] = []

    async def main() -> list[tuple[str, list[Sight]]]:
        seen: list[tuple[str, list[Sight]]] = []
        done = asyncio.Event()
        a, b = subprocess.Popen(SLEEPER), subprocess.Popen(SLEEPER)
        pids.extend([a.pid, b.pid])

        def on_exiting(key: str, sights: list[Sight]) -> None:
            seen.append((key, sights))
            if key == "first":
                watch.watch("second", [b.pid])
            else:
                done.set()

        watch = ExitWatch(0.002, on_exiting)
        try:
            watch.watch("first", [a.pid])
            assert watch.poll() == [] and seen == []  # both alive: nothing to report
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
    assert [s.pid for s in first[1] + second[1]] == pids


def test_a_pid_gone_before_the_watch_starts_is_reported_at_once() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()

    async def main() -> list[Sight]:
        seen: list[Sight] = []
        done = asyncio.Event()
        watch = ExitWatch(0.002, lambda _key, sights: (seen.extend(sights), done.set()))
        watch.watch("gone", [child.pid])
        await asyncio.wait_for(done.wait(), 10)
        await watch.close()
        return seen

    assert asyncio.run(main()) == [Sight(child.pid)]  # how it ended is no longer there


def test_a_bad_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        ExitWatch(0, lambda _k, _p: None)
