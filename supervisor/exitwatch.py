"""Seeing a process begin to exit, before its exit can be waited for.

A process killed while it holds a CUDA context spends 100-150 ms inside the kernel tearing
that context down before its parent (or a pidfd) can see it exit: on an H200 under load a
SIGKILLed primary was promoted away from 107-156 ms after its last heartbeat, all of it
spent waiting for the exit. It runs no user code from the first step of that exit: the
kernel marks the thread PF_EXITING before anything else, and /proc/<pid>/stat shows that
flag (and, before the process has even been on a CPU again, the SIGKILL pending). `ExitWatch`
reads the stat of a few processes (the primary's ranks) every few milliseconds and reports
the first one that is killed, exiting, a zombie, or gone.

The stat file is opened once per process and read with pread: a file opened on a process
keeps naming that process, so a reused pid is never mistaken for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable

from supervisor.realtime import RealtimeSection

PF_EXITING = 0x4  # include/linux/sched.h: getting shut down
SIGKILL_BIT = 1 << (signal.SIGKILL - 1)


def stat_says_exiting(stat: bytes) -> bool:
    """Whether a /proc/<pid>/stat line is of a process that exits or has exited: state Z
    (zombie) or X (dead), or the PF_EXITING flag set (field 9)."""
    fields = stat[stat.rindex(b")") + 2 :].split()  # the name may hold spaces and ')'
    state, flags = fields[0], int(fields[6])
    return state in (b"Z", b"X", b"x") or bool(flags & PF_EXITING)


def status_says_killed(status: bytes) -> bool:
    """Whether /proc/<pid>/status shows SIGKILL pending (SigPnd: the thread's, ShdPnd: the
    process's): a killed process that has not been on a CPU since, which will run no more
    user code (a thread handles SIGKILL before any)."""
    for key in (b"\nSigPnd:", b"\nShdPnd:"):
        at = status.find(key)
        if at >= 0 and int(status[at + len(key) :].split(None, 1)[0], 16) & SIGKILL_BIT:
            return True
    return False


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
        if len(self.fds) < 2:
            return True
        try:
            stat, status = (os.pread(fd, 4096, 0) for fd in self.fds)
        except ProcessLookupError:  # reaped: the files name a process that no longer is
            return True
        return stat_says_exiting(stat) or status_says_killed(status)

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
    """Polls the stat of one group of processes every `interval_s`; `on_exiting(key, pid)`
    is called once, for the first that is exiting, then the group is dropped.

    With `realtime`, each look runs inside that real-time section, and so does
    `on_exiting` until it leaves the section itself (a promotion does, once routed and
    told): the switch to SCHED_FIFO is made before the look, not in the response to what
    it saw. The section is left at once after a look that saw nothing, and after
    `on_exiting` returns."""

    def __init__(
        self,
        interval_s: float,
        on_exiting: Callable[[str, int], None],
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

    def poll(self) -> int | None:
        """The pid of the first watched process that is exiting, or None."""
        return next((look.pid for look in self._looks if look.done()), None)

    async def _run(self) -> None:
        rt = self._realtime
        while self._looks:
            if rt is not None:
                rt.enter()
            try:
                pid = self.poll()
                if pid is not None:
                    key = self._key
                    self.clear()
                    self._on_exiting(key, pid)  # may watch() the next group: the loop goes on
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
