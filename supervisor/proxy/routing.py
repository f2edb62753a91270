"""How the router sends a request to the primary that `PrimaryView` names
(supervisor/primary.py): the tries of one request, plain or streamed (`Tries`: the retry
rule, a 421 from a node that no longer leads, waiting for a primary), the headers it
forwards, what it counts (`Tally`), its events, and its errors in the engines' OpenAI
shape."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
from aiohttp import web

from holdfast_contract.events import EventName
from supervisor.aio import unless_set
from supervisor.histogram import Histogram
from supervisor.policy import RouterSpec
from supervisor.primary import PrimaryView, Target, choose

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
# how a cut stream's continuation began: `continued`, the stall histogram's label
CONTINUED = ("adopted", "kept", "replayed")
# upper bounds (s) of the stream stall histogram's buckets
STALL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class NotLeader(Exception):
    """The node forwarded to does not lead (said before any byte of an answer)."""


class Superseded(Exception):
    """A primary superseded by a rolling update refused a request it got after the switch
    (503, draining): nothing was answered, so it goes to the primary routed now."""


UPSTREAM_ERRORS = (
    aiohttp.ClientConnectionError,
    aiohttp.ClientPayloadError,
    OSError,
    NotLeader,
    Superseded,
)
NOT_LEADER_WAIT_S = 0.02  # after a 421, ask the same term again this much later at most
A = TypeVar("A")  # what a try answers


def error(status: int, message: str, kind: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind}}, status=status)


def not_leader() -> web.Response:
    """421 to another node's router: this node does not lead; retry on the next leader."""
    resp = error(421, "this node does not lead the cluster", "not_leader")
    resp.headers[NOT_LEADER] = "1"
    return resp


def end_to_end(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """The headers that pass a proxy: none of HOP_BY_HOP."""
    return [(k, v) for k, v in headers if k.lower() not in HOP_BY_HOP]


def refuse_if_not_leading(up: aiohttp.ClientResponse, target: Target) -> None:
    """NotLeader when another node's router answered 421: its node does not lead."""
    if target.remote and up.status == 421 and NOT_LEADER in up.headers:
        raise NotLeader(f"{target.name} answered that it does not lead")


def refuse_if_superseded(up: aiohttp.ClientResponse, target: Target, view: PrimaryView) -> None:
    """Superseded when a local primary of another version than the one routed now (a
    rolling update passed its place on) answered 503: it drains and takes nothing new."""
    now = view.route()
    if (
        up.status == 503
        and not target.remote
        and now is not None
        and now.epoch > target.epoch
        and now.version != target.version
    ):
        raise Superseded(f"{target.name} was superseded by {now.name} (version {now.version})")


def attempts(spec: RouterSpec) -> int:
    """Tries per request: one, and one retry on the next primary when router.retry."""
    return 2 if spec.retry else 1


def gave_up(reason: str, spec: RouterSpec) -> str:
    """`reason`, for a request that waited for a primary to take it over and none came."""
    return f"{reason}; no primary took over within router.retry_deadline_s ({spec.retry_deadline_s:g} s)"


async def next_primary(
    view: PrimaryView, epoch: int, deadline: float, stopped: asyncio.Event
) -> Target | None:
    """`PrimaryView.next_after`, or None at once when the router stops (`stopped`)."""
    if stopped.is_set():
        return None
    now = choose(view.route(), epoch)
    if now is not None:  # (after a cut, the next primary is routed to already)
        return now
    waited = await unless_set(view.next_after(epoch, deadline), stopped)
    return None if waited is None else waited.result()


@dataclass
class Tally:
    """What one router counts, read by GET /metrics (supervisor/metrics.py)."""

    forwarded: int = 0  # requests answered by a primary
    retried: int = 0  # on the next primary
    failed: int = 0  # no primary could answer
    broken: int = 0  # responses cut off after their first byte
    migrations: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(("attempted", "succeeded", "failed"), 0)
    )
    # seconds, by how the continuation began (cuts.CONTINUED): from the dead primary's KV
    # cache, from a past kept warm, or computed again from the tokens sent
    stalls: dict[str, Histogram] = field(
        default_factory=lambda: {how: Histogram(STALL_BUCKETS) for how in CONTINUED}
    )


@dataclass(frozen=True)
class Events:
    """Where one router's events go: `router.<node or main>.<event>` on the bus."""

    node: str = ""  # this node's name in a cluster; "" alone
    emit: Emit | None = None

    def __call__(self, event: EventName, epoch: int, **data: Any) -> None:
        if self.emit is not None:
            self.emit("router", self.node or "main", event, epoch, **data)


class Routes:
    """Where one router's requests go: its view of the primary, its retry rule, its node's
    name on requests to another node's router, whether it stops (from then on nothing
    waits for a primary), and what it counts (`tally`)."""

    def __init__(self, spec: RouterSpec, view: PrimaryView, node: str) -> None:
        self.spec = spec
        self.view = view
        self.node = node
        self.tally = Tally()
        self.stopped = asyncio.Event()

    @property
    def stopping(self) -> bool:
        return self.stopped.is_set()

    def tries(self, request: web.Request, deadline: float) -> Tries:
        return Tries(self, FORWARDED_BY in request.headers, deadline)

    def headers(self, request: web.Request, target: Target) -> dict[str, str]:
        """The client's headers as they go to `target`."""
        headers = dict(end_to_end(request.headers.items()))
        if target.remote:
            headers[FORWARDED_BY] = self.node or "-"
        return headers


class Tries:
    """The tries of one request, plain or streamed: sent to the primary once it took its
    promotion (waiting for one up to the deadline). After a failure `failed` says what
    next: an answer, a target (`retry`: the next primary, at most `attempts` tries;
    `again`: after a 421, the same term a moment later; `follow`: where a cut stream goes
    on), or None: give up, for `reason`."""

    def __init__(self, routes: Routes, forwarded: bool, deadline: float) -> None:
        self.routes = routes
        self.forwarded = forwarded  # sent by another node's router
        self.deadline = deadline
        self.reason = "no primary is serving"
        self._left = attempts(routes.spec)

    async def run(
        self,
        send: Callable[[Target], Awaitable[A]],
        failed: Callable[[Exception, Target], Awaitable[A | Target | None]],
        errors: tuple[type[Exception], ...],
    ) -> A | None:
        """`send`'s answer from the first target that gives one, or None: none did."""
        view = self.routes.view
        target = choose(view.route(), -1) or await self.next_primary(-1)
        while target is not None:
            if not target.remote:
                await view.acked(self.deadline)
                target = view.route() or target
            try:
                if not view.valid(target) or (target.remote and self.forwarded):
                    raise NotLeader(f"{target.node or target.name} is not leading here")
                return await send(target)
            except errors as e:
                step = await failed(e, target)
            if not isinstance(step, Target | None):
                return step
            target = step
        return None

    async def next_primary(self, epoch: int) -> Target | None:
        return await next_primary(self.routes.view, epoch, self.deadline, self.routes.stopped)

    async def retry(self, failed: Target) -> Target | None:
        """The next primary after `failed`, which answered nothing: None once the tries
        are spent, or none took over by the deadline."""
        self._left -= 1
        if self._left <= 0:
            return None
        self.routes.tally.retried += 1
        target = await self.next_primary(failed.epoch)
        if target is None:
            self.reason = gave_up(self.reason, self.routes.spec)
        return target

    async def again(self, target: Target) -> Target | None:
        """After another node's router said its node does not lead (or its term ended as
        seen here): the same term a moment later, or the next; not a failed try."""
        return await self.routes.view.again(target, self.deadline, NOT_LEADER_WAIT_S)

    async def follow(self, cut: Target) -> Target | None:
        """Where a stream cut after its first byte goes on, within a new deadline: after
        another node's router, that node again once it leads (it may resume the same
        term: its router continued or handed the stream back), or the next leader; after
        this node's primary, a later epoch."""
        self.deadline = time.monotonic() + self.routes.spec.retry_deadline_s
        target = await (self.again(cut) if cut.remote else self.next_primary(cut.epoch))
        if target is None:
            self.reason = gave_up(self.reason, self.routes.spec)
        return target
