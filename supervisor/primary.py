"""Where the supervisor routes: the current primary (`PrimaryView`, which a cluster node
extends: supervisor.fleet.node), the `Target` a request goes to, and which target a
request may go to next (`choose`). The supervisor's core sets it; the HTTP proxy
(supervisor/proxy/) reads it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass


class LeadershipEnded(Exception):
    """This node's term ended while a response from its local primary was under way."""


@dataclass(frozen=True)
class Target:
    """Where requests go: a local engine, or (`remote`) another node's router.

    `epoch` orders targets for the retry rule; `node` and `cluster_epoch` are set in a
    cluster (docs/fleet.md) and sent as X-Holdfast-Node / X-Holdfast-Cluster-Epoch;
    `version` names the model version whose pool it runs on (docs/update.md)."""

    name: str
    port: int
    epoch: int
    host: str = "127.0.0.1"
    node: str = ""
    cluster_epoch: int = 0
    remote: bool = False
    version: str = ""  # the model version it serves (X-Holdfast-Model-Version)


def choose(current: Target | None, after_epoch: int) -> Target | None:
    """Where a request goes: the current primary when its epoch is later than
    `after_epoch` (-1 for a first attempt; the failed primary's epoch for the retry),
    else None: wait for the next promotion. A failed primary is never tried twice."""
    if current is None or current.epoch <= after_epoch:
        return None
    return current


class PrimaryView:
    """The current primary, whether it acknowledged its promotion, and the next one."""

    ACK_WAIT_S = 1.0  # forward anyway if an engine does not acknowledge by then

    def __init__(self) -> None:
        self.target: Target | None = None
        # the standby promoted next, where the router keeps streams' pasts warm (None:
        # none ready, or the engines keep nothing warm; set by the supervisor)
        self.heir: Target | None = None
        # (from, to): an answer cut on an engine of version `from` may go on on one of
        # version `to` (a refit with update.refit_inflight: retry; set by the supervisor)
        self.continues: set[tuple[str, str]] = set()
        # whether every stream under way has its past kept warm on this engine (set by
        # the router: supervisor/proxy/warming.py; True where nothing is warmed)
        self.warm_on: Callable[[Target], bool] = lambda _engine: True
        self._changed = asyncio.Event()
        self._acked = asyncio.Event()
        self._listeners: list[Callable[[Target | None], None]] = []

    def on_set(self, fn: Callable[[Target | None], None]) -> None:
        """Call `fn(target)` at each `set`, once the target has changed."""
        self._listeners.append(fn)

    def set(self, target: Target | None, *, await_ack: bool = False) -> None:
        """Route to `target`; with `await_ack`, hold requests until `ack(name)` (bounded)."""
        self.target = target
        self._acked = asyncio.Event()
        if not await_ack:
            self._acked.set()
        self.wake()
        for fn in self._listeners:
            fn(target)

    def wake(self) -> None:
        """Requests waiting for a primary look again."""
        self._changed.set()
        self._changed = asyncio.Event()

    def ack(self, name: str) -> None:
        if self.target is not None and self.target.name == name:
            self._acked.set()

    async def acked(self, deadline: float) -> None:
        """Wait until the current primary took its promotion, at most ACK_WAIT_S."""
        left = min(deadline - time.monotonic(), self.ACK_WAIT_S)
        if self._acked.is_set() or left <= 0:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(left):
                await self._acked.wait()

    def route(self) -> Target | None:
        """Where a request goes now (a cluster node overrides this: supervisor.fleet.node)."""
        return self.target

    def valid(self, target: Target) -> bool:
        """Whether `target`, chosen a moment ago, may still be forwarded to."""
        return True

    def misdirected(self) -> bool:
        """Whether a request another node's router forwarded here must be refused (421)."""
        return False

    def serving(self, target: Target) -> contextlib.AbstractAsyncContextManager[None]:
        """Held while a request to `target` is under way; a cluster leader raises
        LeadershipEnded out of it when its term ends."""
        return contextlib.nullcontext()

    async def again(self, target: Target, deadline: float, wait_s: float) -> Target | None:
        """After a 421 from `target`: where to go `wait_s` later (or at the next change),
        the same term included; None at the deadline."""
        left = min(wait_s, deadline - time.monotonic())
        if left <= 0:
            return None
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(left):
                await self._changed.wait()
        return choose(self.route(), target.epoch - 1) or await self.next_after(
            target.epoch - 1, deadline
        )

    async def next_after(self, epoch: int, deadline: float) -> Target | None:
        """A primary of an epoch later than `epoch`, or None at the deadline."""
        while (target := choose(self.route(), epoch)) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                async with asyncio.timeout(left):
                    await self._changed.wait()
            except TimeoutError:
                return None
        return target
