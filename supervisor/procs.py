"""Child processes: each in its own process group, output to a log file, exit seen at once.

`Proc.spawn` starts one process (asyncio subprocess; the event loop's child watcher reports
its exit the moment it happens). Fencing kills the whole process group with SIGKILL and
confirms the leader is gone; termination is SIGTERM, a grace period, then SIGKILL.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import os
import signal
import socket
import time
from pathlib import Path

from supervisor.errors import StartupError


class Proc:
    def __init__(self, proc: asyncio.subprocess.Process, argv: list[str], log: Path) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.argv = argv
        self.log = log
        self.started = time.monotonic()

    @classmethod
    async def spawn(cls, argv: list[str], env: dict[str, str], log: Path) -> Proc:
        with open(log, "ab") as out:
            try:
                proc = await asyncio.create_subprocess_exec(
                    *argv, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=out,
                    stderr=asyncio.subprocess.STDOUT, start_new_session=True,
                    preexec_fn=_die_with_parent)
            except OSError as e:
                raise StartupError(f"cannot start {argv[0]!r}: {e.strerror}; fix the command "
                                   "in the policy (engines.command)") from e
        return cls(proc, argv, log)

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

    async def wait(self) -> int:
        return await self.proc.wait()

    def kill_group(self, sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    async def fence(self, timeout: float = 2.0) -> bool:
        """SIGKILL the whole group; True once the leader's exit is confirmed."""
        self.kill_group(signal.SIGKILL)
        try:
            async with asyncio.timeout(timeout):
                await self.proc.wait()
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
                await self.proc.wait()
        except TimeoutError:
            pass
        await self.fence()

    def tail(self, limit: int = 2000) -> str:
        """The last `limit` bytes the process wrote (stdout and stderr)."""
        try:
            with open(self.log, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - limit))
                return f.read().decode(errors="replace")
        except OSError:
            return ""


_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it if the supervisor dies, however it dies."""
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port
