"""Ending tasks for sure. A single `Task.cancel()` can be lost: on Python 3.11,
`asyncio.wait_for` returns the result instead of raising when its future completes in the
same step as the cancellation (CPython gh-86296), and libraries wrap their waits in it.
And running a coroutine only until an event is set (`unless_set`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
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
