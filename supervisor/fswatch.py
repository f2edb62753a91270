"""Wait for a file to appear in a directory, or for any change to the files in one, woken
by inotify rather than polling."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import os
from collections.abc import Callable
from pathlib import Path

IN_MODIFY = 0x002
IN_ATTRIB = 0x004
IN_CLOSE_WRITE = 0x008
IN_MOVED_FROM = 0x040
IN_MOVED_TO = 0x080
IN_CREATE = 0x100
IN_DELETE = 0x200
APPEARS = IN_CLOSE_WRITE | IN_MOVED_TO | IN_CREATE  # a file written, moved in or made
# any change to a file's bytes or stat facts, or to which files there are
CHANGES = APPEARS | IN_MODIFY | IN_ATTRIB | IN_MOVED_FROM | IN_DELETE
IN_NONBLOCK = 0o4000
IN_CLOEXEC = 0o2000000

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


class DirWatch:
    """An inotify watch on one dir; `await wait(check, timeout)` until `check()` is true,
    or `await changed()` until anything in it changes (`mask=CHANGES`)."""

    def __init__(self, path: Path, mask: int = APPEARS) -> None:
        self.fd = _libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        if _libc.inotify_add_watch(self.fd, os.fsencode(path), mask) < 0:
            err = ctypes.get_errno()
            os.close(self.fd)
            raise OSError(err, f"inotify_add_watch failed on {path}")

    async def wait(self, check: Callable[[], bool], timeout: float) -> bool:
        loop = asyncio.get_running_loop()
        changed = asyncio.Event()
        loop.add_reader(self.fd, self._drain, changed)
        try:
            async with asyncio.timeout(timeout):
                while not check():
                    await changed.wait()
                    changed.clear()
        except TimeoutError:
            return False
        finally:
            loop.remove_reader(self.fd)
        return True

    async def changed(self) -> None:
        """Until the next events on the dir (all that are queued then are read)."""
        loop = asyncio.get_running_loop()
        event = asyncio.Event()
        loop.add_reader(self.fd, self._drain, event)
        try:
            await event.wait()
        finally:
            loop.remove_reader(self.fd)

    def _drain(self, changed: asyncio.Event) -> None:
        try:
            while os.read(self.fd, 65536):
                pass
        except BlockingIOError:
            pass
        changed.set()

    def close(self) -> None:
        os.close(self.fd)
