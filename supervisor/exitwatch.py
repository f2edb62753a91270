"""Seeing a process begin to exit, before its exit can be waited for.

A process killed while it holds a CUDA context spends 100-150 ms inside the kernel tearing
that context down before its parent (or a pidfd) can see it exit: on an H200 under load a
SIGKILLed primary was promoted away from 107-156 ms after its last heartbeat, all of it
spent waiting for the exit. It runs no user code from the first step of that exit: the
kernel marks the thread PF_EXITING before anything else, and /proc/<pid>/stat shows that
flag (and, before the process has even been on a CPU again, the SIGKILL pending). `ExitWatch`
reads the stat of a few processes (the primary's ranks) every few milliseconds and reports,
at the first look that sees any, every one that is killed, exiting, a zombie, or gone, with
how it ends where the kernel says so already (the exit code it sets before the teardown).

Several ranks of a group can be done at that look: one died, and the others went because
of it (the supervisor killed their group, or a rank left its broken group with
`EXIT_PEER_LOST`). `first_death` picks the one that brought the group down.

The stat file is opened once per process and read with pread: a file opened on a process
keeps naming that process, so a reused pid is never mistaken for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from holdfast_contract.procfs import SIGKILL_BIT, stat_says_exiting, status_says_killed
from supervisor.realtime import RealtimeSection

# the status a rank of the reference engine exits with once its group lost a peer
# (engine.peerwatch.EXIT_BROKEN): it goes because another rank went
EXIT_PEER_LOST = 3


@dataclass(frozen=True)
class Sight:
    """One watched process seen done; `code` says how it ends as a wait status would
    (-N: killed by signal N, else its exit status), None while the kernel does not say."""

    pid: int
    code: int | None = None


@dataclass(frozen=True)
class Death:
    """One rank of a group seen done: how it ends (as `Sight.code`), and whether the
    supervisor itself had signalled its process group (then it goes because another went)."""

    rank: int
    code: int | None
    signalled: bool

    def detail(self) -> str:
        how = (
            ""
            if self.code is None
            else f" (killed by signal {-self.code})"
            if self.code < 0
            else f" (exit status {self.code})"
        )
        return f"rank {self.rank} is exiting{how}"


def first_death(deaths: Sequence[Death]) -> Death:
    """Of the ranks of one group seen done at one look, the one whose death brought the
    group down: never one the supervisor signalled itself, nor one that leaves because a
    peer is gone (`EXIT_PEER_LOST`), while another is there; then the lowest rank."""
    if not deaths:
        raise ValueError("first_death needs at least one rank seen done")
    return min(deaths, key=lambda d: (d.signalled, d.code == EXIT_PEER_LOST, d.rank))


def stat_exit_code(stat: bytes) -> int | None:
    """How a process that exits ends, from its /proc/<pid>/stat (field 52, the wait status
    the kernel sets as the exit begins, before the teardown): -N for signal N, else the
    exit status; None while it is 0 (not set yet, or a plain exit 0)."""
    fields = stat[stat.rindex(b")") + 2 :].split()
    raw = int(fields[49]) if len(fields) > 49 else 0
    if raw == 0:
        return None
    try:
        return os.waitstatus_to_exitcode(raw)
    except ValueError:
        return None


def shared_kill(status: bytes) -> bool:
    """SIGKILL pending for the whole process (ShdPnd): sent to it, not a thread's share of
    an exit_group() that one of its own threads made."""
    at = status.find(b"\nShdPnd:")
    return at >= 0 and bool(int(status[at + 8 :].split(None, 1)[0], 16) & SIGKILL_BIT)


class Look:
    """The two files that tell whether one process is done running user code, opened once
    (a file opened on a process keeps naming it: a reused pid is never mistaken for it)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.fds: list[int] = []
        try:
            for name in ("stat", "status"):
                self.fds.append(os.open(f"/proc/{pid}/{name}", os.O_RDONLY | os.O_CLOEXEC))
        except (FileNotFoundError, ProcessLookupError):
            self.close()  # already gone: `done` says so

    def done(self) -> bool:
        """Killed (SIGKILL pending), exiting, a zombie, or gone."""
        return self.see() is not None

    def see(self) -> Sight | None:
        """None while it runs; once killed, exiting, a zombie or gone, how it ends as far
        as the kernel says: the exit code it set, or SIGKILL sent to the whole process
        (pending in ShdPnd; a process that exits by itself leaves it only per thread)."""
        if len(self.fds) < 2:
            return Sight(self.pid)
        try:
            stat, status = (os.pread(fd, 4096, 0) for fd in self.fds)
        except ProcessLookupError:  # reaped: the files name a process that no longer is
            return Sight(self.pid)
        if not (stat_says_exiting(stat) or status_says_killed(status)):
            return None
        code = stat_exit_code(stat)
        if code is None and shared_kill(status):
            code = -signal.SIGKILL
        return Sight(self.pid, code)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def is_exiting(pid: int) -> bool:
    """Whether process `pid` is killed, exiting, a zombie, or gone (one look)."""
    look = Look(pid)
    try:
        return look.done()
    finally:
        look.close()


class ExitWatch:
    """Polls the stat of one group of processes every `interval_s`; `on_exiting(key,
    sights)` is called once, with every process of the group that the first look to see
    any found done (in the order given to `watch`), then the group is dropped.

    With `realtime`, each look runs inside that real-time section, and so does
    `on_exiting` until it leaves the section itself (a promotion does, once routed and
    told): the switch to SCHED_FIFO is made before the look, not in the response to what
    it saw. The section is left at once after a look that saw nothing, and after
    `on_exiting` returns."""

    def __init__(
        self,
        interval_s: float,
        on_exiting: Callable[[str, list[Sight]], None],
        realtime: RealtimeSection | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self.interval_s = interval_s
        self._on_exiting = on_exiting
        self._realtime = realtime
        self._key = ""
        self._looks: list[Look] = []
        self._task: asyncio.Task[None] | None = None

    def watch(self, key: str, pids: list[int]) -> None:
        """Watch `pids` (one group, named `key`) instead of whatever was watched."""
        self.clear()
        self._key = key
        self._looks = [Look(pid) for pid in pids if pid > 0]
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="exit-watch")

    def clear(self) -> None:
        for look in self._looks:
            look.close()
        self._looks, self._key = [], ""

    def poll(self) -> list[Sight]:
        """Every watched process that is done now (killed, exiting, a zombie or gone)."""
        return [s for s in (look.see() for look in self._looks) if s is not None]

    async def _run(self) -> None:
        rt = self._realtime
        while self._looks:
            if rt is not None:
                rt.enter()
            try:
                sights = self.poll()
                if sights:
                    key = self._key
                    self.clear()
                    self._on_exiting(key, sights)  # may watch() the next group: loop goes on
                    continue
            finally:
                if rt is not None:
                    rt.leave()
            await asyncio.sleep(self.interval_s)

    async def close(self) -> None:
        self.clear()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
