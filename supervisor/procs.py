"""Child processes: each in its own process group, output to a log file, exit seen at once.

`Proc.spawn` starts one process (asyncio subprocess; the event loop's child watcher reports
its exit the moment it happens). `Proc.fork` asks an engine fork server for one instead,
through `holdfast_contract.forkserver` (the server reports the exit code on the request's
connection; if the server is gone, a pidfd still says when the process ends). Fencing kills the whole process group with SIGKILL and
confirms the leader is gone; termination is SIGTERM, a grace period, then SIGKILL.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import os
import re
import signal
import socket
import time
from collections.abc import Awaitable
from pathlib import Path

from holdfast_contract import forkserver
from holdfast_contract.errors import ForkServerError
from supervisor.errors import StartupError

# log lines that say something went wrong: structlog console and JSON, logging, Python
NOTABLE = re.compile(
    r"\[(warning|error|critical)\s*\]|\"level\": ?\"(warning|error|critical)\"|"
    r"\b(WARNING|ERROR|CRITICAL)\b|^Traceback |^\w+(Error|Exception|Exit)\b|Warning:"
)


def notable_tail(text: str, limit: int = 1024, line_max: int = 240) -> str:
    """The last lines of `text` within about `limit` bytes: first the most recent warnings
    and errors (in up to two thirds of it), then the last lines, each part in order."""
    lines = [ln[:line_max] for ln in text.splitlines() if ln.strip()]
    marked = [i for i, ln in enumerate(lines) if NOTABLE.search(ln)]
    picked: set[int] = set()
    room = limit * 2 // 3
    for i in reversed(marked):
        room -= len(lines[i].encode()) + 1
        if room < 0:
            break
        picked.add(i)
    room = limit - sum(len(lines[i].encode()) + 1 for i in picked)
    last: list[int] = []
    for i in reversed(range(len(lines))):
        if i in picked:
            continue
        room -= len(lines[i].encode()) + 1
        if room < 0:
            break
        last.append(i)
    return "\n".join([lines[i] for i in sorted(picked)] + [lines[i] for i in sorted(last)])


class Proc:
    def __init__(
        self,
        pid: int,
        argv: list[str],
        log: Path,
        exited: Awaitable[int | None],
        log_start: int = 0,
    ) -> None:
        self.pid = pid
        self.argv = argv
        self.log = log
        self.log_start = log_start  # where this process's output begins in `log`
        self.started = time.monotonic()
        # the supervisor signalled its group while it still ran (kill_group): it then goes
        # because of that, not of its own accord
        self.signalled = False
        self._exit = asyncio.ensure_future(exited)

    @classmethod
    async def spawn(cls, argv: list[str], env: dict[str, str], log: Path) -> Proc:
        with open(log, "ab") as out:
            start = out.tell()
            try:
                proc = await asyncio.create_subprocess_exec(
                    *argv,
                    env=env,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=out,
                    stderr=asyncio.subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=_die_with_parent,
                )
            except OSError as e:
                raise StartupError(
                    f"cannot start {argv[0]!r}: {e.strerror}; fix the command "
                    "in the policy (engines.command)"
                ) from e
        return cls(proc.pid, argv, log, proc.wait(), start)

    @classmethod
    async def fork(cls, server: Path, argv: list[str], env: dict[str, str], log: Path) -> Proc:
        """An engine forked by the fork server at `server`; `argv` is `python -m MODULE ...`
        (only the flags travel). StartupError if the server does not answer."""
        request = forkserver.Spawn(argv=argv[3:], env=env, cwd=os.getcwd(), owner=os.getpid())
        with open(log, "ab") as out, open(os.devnull, "rb") as null:
            start = out.tell()
            fds = [null.fileno(), out.fileno(), out.fileno()]
            try:
                sock, pid = await asyncio.to_thread(forkserver.request, server, request, fds)
            except ForkServerError as e:
                raise StartupError(str(e)) from e
        try:
            pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:  # already gone: the server's Exited says how
            pidfd = None
        return cls(pid, argv, log, _forked_exit(sock, pidfd), start)

    def moved(self, argv: list[str], log: Path, log_start: int) -> Proc:
        """This process, running `argv` and writing to `log` (from `log_start`) from now
        on: a parked cache daemon once claimed (supervisor/update/parked.py)."""
        return Proc(self.pid, argv, log, self._exit, log_start)

    @property
    def alive(self) -> bool:
        return not self._exit.done()

    @property
    def returncode(self) -> int | None:
        """Once exited: the code (None if unknown); before: None."""
        ended = self._exit.done() and not self._exit.cancelled()
        return self._exit.result() if ended and self._exit.exception() is None else None

    async def wait(self) -> int | None:
        """The exit code (-N for signal N); None for a forked one whose server died first."""
        return await asyncio.shield(self._exit)

    def kill_group(self, sig: int = signal.SIGKILL) -> None:
        if self.alive:  # a rank already seen exiting went of its own accord
            self.signalled = True
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    async def fence(self, timeout: float = 2.0) -> bool:
        """SIGKILL the whole group; True once the leader's exit is confirmed."""
        self.kill_group(signal.SIGKILL)
        try:
            async with asyncio.timeout(timeout):
                await self.wait()
        except TimeoutError:
            return False
        return True

    async def terminate(self, grace: float) -> None:
        """SIGTERM the group, wait up to `grace`, then SIGKILL it."""
        if not self.alive:
            self.kill_group(signal.SIGKILL)
            return
        self.kill_group(signal.SIGTERM)
        try:
            async with asyncio.timeout(grace):
                await self.wait()
        except TimeoutError:
            pass
        await self.fence()

    def tail(self, limit: int = 1024, window: int = 64 * 1024) -> str:
        """What this process wrote (stdout and stderr; not earlier processes that wrote to
        the same log), in at most `limit` bytes: warnings and errors first, then its last
        lines. Only the last `window` bytes are read."""
        try:
            with open(self.log, "rb") as f:
                end = f.seek(0, os.SEEK_END)
                begin = max(self.log_start, end - window)
                f.seek(begin)
                data = f.read()
        except OSError:
            return ""
        if begin > self.log_start:  # cut inside a line: drop the part
            data = data.partition(b"\n")[2]
        return notable_tail(data.decode(errors="replace"), limit)


async def _forked_exit(sock: socket.socket, pidfd: int | None) -> int | None:
    """A forked child's exit code, from its fork server; if that connection breaks first,
    wait for the process itself through its pidfd (its code is then unknown: None)."""
    try:
        with sock:
            await _readable(sock.fileno())
            sock.settimeout(5.0)  # the frame is there, or EOF
            try:
                reply = forkserver.read_reply(sock)
            except ForkServerError:
                reply = None
        if isinstance(reply, forkserver.Exited):
            return reply.code
        if pidfd is not None:
            await _readable(pidfd)
        return None
    finally:
        if pidfd is not None:
            os.close(pidfd)


async def _readable(fd: int) -> None:
    loop = asyncio.get_running_loop()
    ready = asyncio.Event()
    loop.add_reader(fd, ready.set)
    try:
        await ready.wait()
    finally:
        loop.remove_reader(fd)


_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it if the supervisor dies, however it dies."""
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
