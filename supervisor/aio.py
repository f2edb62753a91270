"""Owning tasks, and ending them for sure. A single `Task.cancel()` can be lost: on Python 3.11,
`asyncio.wait_for` returns the result instead of raising when its future completes in the
same step as the cancellation (CPython gh-86296), and libraries wrap their waits in it.
And running a coroutine only until an event is set (`unless_set`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from types import TracebackType
from typing import Any, TypeVar

import structlog

log = structlog.get_logger("supervisor")

_RECANCEL_S = 0.05
T = TypeVar("T")


async def finish(task: asyncio.Task[Any], grace: float) -> bool:
    """Wait up to `grace` seconds for `task` to end by itself; then cancel it, again and
    again until it ends. True if it ended by itself."""
    if grace > 0:
        await asyncio.wait([task], timeout=grace)
    ended = task.done()
    while not task.done():
        task.cancel()
        await asyncio.wait([task], timeout=_RECANCEL_S)
    if not task.cancelled() and task.exception() is not None:
        log.error("task_failed", task=task.get_name(), error=repr(task.exception()))
    return ended


async def cancel_all(tasks: list[asyncio.Task[Any]]) -> None:
    """Cancel every task and wait until each has ended, re-cancelling lost cancellations."""
    await asyncio.gather(*(finish(t, 0) for t in tasks))


class Owned:
    """Tasks that live as long as the block that owns them (`async with Owned() as
    tasks`), as an `asyncio.TaskGroup`'s, and are cancelled for sure (`cancel_all`) as
    the block ends. A task that fails does not cancel its owner, whatever it is doing (a
    stop under way is not cut short): its failure is kept in `failures`, and `failed` is
    set for the owner to look."""

    def __init__(self) -> None:
        self._group = asyncio.TaskGroup()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.failed = asyncio.Event()
        self.failures: list[tuple[str, Exception]] = []

    async def __aenter__(self) -> Owned:
        await self._group.__aenter__()
        return self

    async def __aexit__(
        self,
        et: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await cancel_all(list(self._tasks.values()))
        # every task has ended; the block's own exception (if any) goes on as it is, not
        # wrapped in an ExceptionGroup by the TaskGroup
        await self._group.__aexit__(None, None, None)

    def start(self, coro: Coroutine[Any, Any, Any], name: str) -> None:
        """Run `coro` as the task `name` until it ends or the block does."""
        self._tasks[name] = self._group.create_task(self._kept(coro, name), name=name)

    async def stop(self, name: str) -> None:
        """End the task `name` now, if it was started."""
        task = self._tasks.get(name)
        if task is not None:
            await cancel_all([task])

    async def _kept(self, coro: Coroutine[Any, Any, Any], name: str) -> None:
        try:
            await coro
        except Exception as e:  # (a cancellation is no failure)
            self.failures.append((name, e))
            self.failed.set()
        finally:
            coro.close()  # one cancelled before its first step was never awaited


async def unless_set(coro: Coroutine[Any, Any, T], event: asyncio.Event) -> asyncio.Task[T] | None:
    """Run `coro` unless `event` is set first: its task, done (`result()` gives what it
    returned or raises what it raised), or None when the event came first; then the task
    is cancelled and has ended before this returns."""
    work = asyncio.ensure_future(coro)
    halt = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait([work, halt], return_when=asyncio.FIRST_COMPLETED)
    finally:
        halt.cancel()
        if not work.done():
            work.cancel()
    if work.done() and not work.cancelled():
        return work
    with contextlib.suppress(asyncio.CancelledError):
        await work
    return None
