"""Owning child processes, written once for every sort (circus has one Watcher for all).

Each sort gives three things: its start command (`Command`: argv, environment, log file), its
readiness probe and its health probe. A `Watcher` does the rest the same way for each:
it spawns the process into a process group of its own (`Proc.spawn`), watches its exit in
a task (`watch`; one_for_all for a group of ranks), runs the child's probes as tasks it
owns (`own`), and cancels them all on `stop`. `until_ready` waits for a ready file or
socket with a deadline, `until` for a unit's state to settle, and `not_ready` says why a
unit did not get ready in time, with its log tail.

The sorts: engines (`engines.EngineLauncher`, probes per engine kind in `kinds`),
the fork server (`engines.ForkServer`), cache daemons and their spares
(`daemons.CacheDaemons`). What to do about an exit, a silence or a missed deadline is not
decided here: `decisions`, `reconcile` and `core.Crew` do that.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from supervisor.fswatch import DirWatch
from supervisor.procs import Proc
from supervisor.units import Handle, Incarnation

ExitFn = Callable[[int, int | None], None]  # (the rank that exited first, its exit code)


@dataclass(frozen=True)
class Command:
    """How one child process starts: argv, its whole environment, where its output goes."""

    argv: list[str]
    env: dict[str, str]
    log: Path


class Watcher:
    """Owns the processes of one sort of unit: their exit watches and probes are tasks it
    started, and `stop` cancels every one of them."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[None]] = set()

    def own(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run `coro` as a task this watcher owns until it ends or `stop`."""
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    @staticmethod
    async def spawn(cmd: Command) -> Proc:
        """`cmd` started in a session (process group) of its own; StartupError if it cannot."""
        return await Proc.spawn(cmd.argv, cmd.env, cmd.log)

    @staticmethod
    async def fork(server: Path, cmd: Command) -> Proc:
        """`cmd` forked by the engine fork server at `server` (a session of its own there);
        StartupError if the server does not answer."""
        return await Proc.fork(server, cmd.argv, cmd.env, cmd.log)

    def watch(self, inc: Incarnation, on_exit: ExitFn, *, one_for_all: bool = True) -> None:
        """Call `on_exit(rank, code)` when a process of `inc` exits, unless its end has been
        handled already. With `one_for_all` the group goes with it: every process group of
        `inc` is killed and the others' exits waited for (up to 2 s) first."""
        self.own(self._watch(inc, on_exit, one_for_all))

    async def _watch(self, inc: Incarnation, on_exit: ExitFn, one_for_all: bool) -> None:
        rank, code = await first_exit(inc.procs) if one_for_all else (0, await inc.procs[0].wait())
        if not inc.handled:
            on_exit(rank, code)

    async def stop(self) -> None:
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def first_exit(procs: Sequence[Handle]) -> tuple[int, int | None]:
    """The first of `procs` to exit (its rank, its code), once every process group of them
    is killed and the others' exits confirmed (or 2 s passed). First in the order the
    exits were reported, also when several were before this task ran again."""
    waits = [asyncio.ensure_future(p.wait()) for p in procs]
    order: list[int] = []  # ranks, as their exits came (before asyncio.wait's own callback)

    def noted(rank: int) -> Callable[[object], None]:
        return lambda _: order.append(rank)

    for rank, w in enumerate(waits):
        w.add_done_callback(noted(rank))
    _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    first = waits[order[0]]
    for p in procs:  # one_for_all: the rest of the group goes too, confirmed
        p.kill_group()
    if pending:
        await asyncio.wait(pending, timeout=2.0)
    for w in pending:
        w.cancel()
    return order[0], first.result()


async def until_ready(
    where: Path, ready: Callable[[], bool], timeout: float, unless: Handle | None = None
) -> bool:
    """True once `ready()` holds (looked at again whenever a file in `where` is created,
    written or moved in: inotify, no polling); False after `timeout` seconds, or as soon as
    the process `unless` exits."""
    watch = DirWatch(where)
    try:
        if unless is None:
            return await watch.wait(ready, timeout)
        seen = asyncio.ensure_future(watch.wait(ready, timeout))
        died = asyncio.ensure_future(unless.wait())
        await asyncio.wait([seen, died], return_when=asyncio.FIRST_COMPLETED)
        for t in (seen, died):
            t.cancel()
        await asyncio.gather(seen, died, return_exceptions=True)
        return bool(seen.done() and not seen.cancelled() and seen.result())
    finally:
        watch.close()


async def until(
    done: Callable[[], bool], failed: Callable[[], bool], changed: asyncio.Event, deadline: float
) -> bool:
    """True once `done()` holds, looked at each time `changed` is set; False as soon as
    `failed()` holds or the monotonic clock passes `deadline`."""
    while not done():
        left = deadline - time.monotonic()
        if failed() or left <= 0:
            return False
        changed.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(left):
                await changed.wait()
    return True


async def not_ready(
    what: str, inc: Incarnation | None, log: Path, serve: tuple[str, str], deadline: str
) -> str:
    """Why `what` (started as `inc`, writing to `log`) is not ready: it died (how, when,
    its last log lines), or it is still alive past `deadline` (the setting and what to do
    about it). `serve` is what being ready is called, now and done: ("serve", "served")."""
    tail = inc.tail(2000) if inc else ""
    lines = f"; its last log lines ({log}):\n{tail}" if tail else f"; see {log}"
    proc = inc.procs[0] if inc and inc.procs else None
    if proc is not None and proc.alive:
        return f"{what} (pid {proc.pid}) did not {serve[0]} within {deadline}{lines}"
    code = await proc.wait() if proc is not None else None  # it has exited
    how = (
        "exit status unknown"
        if code is None
        else f"killed by signal {-code}"
        if code < 0
        else f"exit status {code}"
    )
    after = time.monotonic() - inc.started if inc else 0.0
    return f"{what} died {after:.1f} s after it started, before it {serve[1]} ({how}){lines}"
