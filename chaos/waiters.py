"""Wait for the first row that matches, with a deadline: futures resolved as rows arrive.

Cancellation-safe (no lock is held while waiting), so a waiter may be cancelled at any time.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Rows(Generic[T]):
    def __init__(self) -> None:
        self.items: list[T] = []
        self._waiters: list[tuple[Callable[[T], bool], asyncio.Future[T]]] = []
        self._tick = asyncio.Event()

    def append(self, item: T) -> None:
        self.items.append(item)
        for match, future in self._waiters:
            if not future.done() and match(item):
                future.set_result(item)
        self._tick.set()
        self._tick = asyncio.Event()

    async def first(self, match: Callable[[T], bool], timeout: float) -> T | None:
        """The first row (already here or still to come) that matches, or None at `timeout`."""
        found = next((item for item in self.items if match(item)), None)
        if found is not None:
            return found
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        entry = (match, future)
        self._waiters.append(entry)
        try:
            with contextlib.suppress(TimeoutError):
                return await asyncio.wait_for(future, max(timeout, 0.0))
            return None
        finally:
            self._waiters.remove(entry)

    async def changed(self, timeout: float) -> None:
        """Return at the next row, or after `timeout` seconds."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._tick.wait(), max(timeout, 0.0))
