"""Processes the suite started (directly or through the supervisor), by (pid, start time).

Signals go only to a process whose start time still matches, so a recycled pid is never hit.
Exits are awaited on a pidfd, not by polling.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Iterable
from pathlib import Path

import msgspec


class ProcRef(msgspec.Struct, frozen=True):
    pid: int
    start: int  # clock ticks since boot, /proc/<pid>/stat field 22

    @classmethod
    def of(cls, pid: int) -> ProcRef | None:
        start = _start_time(pid)
        return cls(pid, start) if start is not None else None

    def alive(self) -> bool:
        return _start_time(self.pid) == self.start and _state(self.pid) not in ("Z", "X", "")

    def signal(self, sig: signal.Signals) -> bool:
        """Send `sig` if this is still the same process; False when it is gone."""
        if not self.alive():
            return False
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)
            return True
        return False

    def env(self, key: str) -> str:
        try:
            raw = Path(f"/proc/{self.pid}/environ").read_bytes()
        except OSError:
            return ""
        prefix = key.encode() + b"="
        for item in raw.split(b"\0"):
            if item.startswith(prefix):
                return item[len(prefix) :].decode(errors="replace")
        return ""


def descendants(pid: int) -> list[ProcRef]:
    """Every live process below `pid`, depth first."""
    out: list[ProcRef] = []
    for child in _children(pid):
        ref = ProcRef.of(child)
        if ref is not None:
            out.append(ref)
            out.extend(descendants(child))
    return out


async def wait_gone(refs: Iterable[ProcRef], timeout: float) -> list[ProcRef]:
    """Wait until every process has exited, up to `timeout`; returns those still alive."""
    loop = asyncio.get_running_loop()
    waiters: list[asyncio.Future[None]] = []
    fds: list[int] = []
    for ref in refs:
        if not ref.alive():
            continue
        try:
            fd = os.pidfd_open(ref.pid)
        except ProcessLookupError:
            continue
        fds.append(fd)
        done: asyncio.Future[None] = loop.create_future()
        loop.add_reader(fd, _resolve, done)
        waiters.append(done)
    try:
        if waiters:
            await asyncio.wait(waiters, timeout=timeout)
    finally:
        for fd in fds:
            loop.remove_reader(fd)
            os.close(fd)
    return [ref for ref in refs if ref.alive()] if waiters else []


def _resolve(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)


def _children(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                out.extend(int(c) for c in (task / "children").read_text().split())
    return out


def _stat_fields(pid: int) -> list[str]:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return []
    return text[text.rindex(")") + 2 :].split()


def _start_time(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[19]) if len(fields) > 19 else None


def _state(pid: int) -> str:
    fields = _stat_fields(pid)
    return fields[0] if fields else ""
