"""What the router routes by: the current primary (`PrimaryView`, which a cluster node
extends: supervisor.fleet.node), the `Target` a request goes to, the retry rule, and the
router's errors in the engines' OpenAI shape."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from supervisor.policy import RouterSpec

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
FORWARDED_BY = "X-Holdfast-Forwarded-By"  # set on a request one router sends to another
NOT_LEADER = "X-Holdfast-Not-Leader"  # on a 421: the receiving node no longer leads
Emit = Callable[..., Any]  # EventBus.emit: where the router's events go


class NotLeader(Exception):
    """The node forwarded to does not lead (said before any byte of an answer)."""


class LeadershipEnded(Exception):
    """This node's term ended while a response from its local primary was under way."""


UPSTREAM_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError, NotLeader)
MAX_BODY = 64 * 1024 * 1024  # bytes of one request body
NOT_LEADER_WAIT_S = 0.02  # after a 421, ask the same term again this much later at most


def error(status: int, message: str, kind: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind}}, status=status)


@dataclass(frozen=True)
class Target:
    """Where requests go: a local engine, or (`remote`) another node's router.

    `epoch` orders targets for the retry rule; `node` and `cluster_epoch` are set in a
    cluster (docs/fleet.md) and sent as X-Holdfast-Node / X-Holdfast-Cluster-Epoch."""

    name: str
    port: int
    epoch: int
    host: str = "127.0.0.1"
    node: str = ""
    cluster_epoch: int = 0
    remote: bool = False


def answered_by(headers: MutableMapping[str, str], target: Target) -> None:
    """The headers that say which engine (and, in a cluster, which node's term) answered:
    set by the router that forwarded to its local primary; another router's pass through."""
    headers["X-Holdfast-Engine"] = target.name
    headers["X-Holdfast-Epoch"] = str(target.epoch)
    if target.node:
        headers["X-Holdfast-Node"] = target.node
        headers["X-Holdfast-Cluster-Epoch"] = str(target.cluster_epoch)


class Released(web.StreamResponse):
    """An answer whose bytes leave only while `holds()` is true at that moment: its status
    line and headers (`prepare`), each chunk (`write`) and its end (`write_eof`) are the
    only ways out, and each asks first. A cluster leader's router passes its hold on the
    term (`PrimaryView.valid`, by its own monotonic clock), so nothing its engine answered
    reaches the client once the term is over, however long this process was stopped with
    the answer in its buffers. The first false raises LeadershipEnded; once a byte went
    out it also aborts the connection, so the client sees a cut, never a short answer."""

    def __init__(self, holds: Callable[[], bool], *, status: int = 200, reason: Any = None):
        super().__init__(status=status, reason=reason)
        self.holds = holds
        self.cut = False  # aborted: bytes had gone out under a term that has ended since
        self._client: web.BaseRequest | None = None
        self._ended = False

    def _release(self) -> None:
        if self.cut or self.holds():
            return
        if self._client is not None and self._client.transport is not None:
            self.cut = True
            self._client.transport.abort()
        raise LeadershipEnded("the term ended before the answer left")

    async def prepare(self, request: web.BaseRequest) -> Any:
        if not self.prepared:
            self._release()
            self._client = request
        return await super().prepare(request)

    async def write(self, data: Any) -> None:
        self._release()
        await super().write(data)

    async def write_eof(self, data: bytes = b"") -> None:
        if not self._ended:  # (aiohttp calls it again once the handler returns)
            self._release()
        await super().write_eof(data)
        self._ended = True


def not_leader() -> web.Response:
    """421 to another node's router: this node does not lead; retry on the next leader."""
    resp = error(421, "this node does not lead the cluster", "not_leader")
    resp.headers[NOT_LEADER] = "1"
    return resp


def choose(current: Target | None, after_epoch: int) -> Target | None:
    """Where a request goes: the current primary when its epoch is later than
    `after_epoch` (-1 for a first attempt; the failed primary's epoch for the retry),
    else None: wait for the next promotion. A failed primary is never tried twice."""
    if current is None or current.epoch <= after_epoch:
        return None
    return current


def attempts(spec: RouterSpec) -> int:
    """Tries per request: one, and one retry on the next primary when router.retry."""
    return 2 if spec.retry else 1


def gave_up(reason: str, spec: RouterSpec) -> str:
    """`reason`, for a request that waited for a primary to take it over and none came."""
    return f"{reason}; no primary took over within router.retry_deadline_s ({spec.retry_deadline_s:g} s)"


class PrimaryView:
    """The current primary, whether it acknowledged its promotion, and the next one."""

    ACK_WAIT_S = 1.0  # forward anyway if an engine does not acknowledge by then

    def __init__(self) -> None:
        self.target: Target | None = None
        # the standby promoted next, where the router keeps streams' pasts warm (None:
        # none ready, or the engines keep nothing warm; set by the supervisor)
        self.heir: Target | None = None
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
