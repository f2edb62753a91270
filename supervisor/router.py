"""The router: an HTTP reverse proxy to the current epoch's primary, streaming through.

Requests go only to the primary of the current epoch. A request whose upstream fails before
the first response byte is retried once on the next primary, within the retry deadline; a
request that arrives while no primary serves waits for one within the same deadline.
The router's own errors (413, 502, 503) have the OpenAI error shape the engines use:
`{"error": {"message": ..., "type": ...}}`.

A streamed completion or chat completion cut after its first byte (the primary died or
was fenced) is migrated: continued on the next primary by token replay
(supervisor/migration.py), at most `router.migration_limit` times. A stream that cannot be
continued ends with an error event in the same shape and no `data: [DONE]`: never a clean
end. Once the supervisor stops (`stop()`), new requests get 503 with Retry-After at once and
those under way finish within the engines' stop grace.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import structlog
from aiohttp import web

from supervisor import migration
from supervisor.migration import Stalls, Stream, StreamCut
from supervisor.policy import RouterSpec

log = structlog.get_logger("supervisor.router")

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


class NotLeader(Exception):
    """The node forwarded to does not lead (said before any byte of an answer)."""


class LeadershipEnded(Exception):
    """This node's term ended while a response from its local primary was under way."""


UPSTREAM_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError, NotLeader)
MAX_BODY = 64 * 1024 * 1024  # bytes of one request body
NOT_LEADER_WAIT_S = 0.02  # after a 421, ask the same term again this much later at most
BUSY_WAIT_S = 0.01  # a continuation answered 503 (busy) is asked again this much later
STOPPING_RETRY_AFTER_S = 1  # Retry-After of the 503 a stopping router answers
CUT = (*UPSTREAM_ERRORS, StreamCut, LeadershipEnded)
Emit = Callable[..., Any]  # EventBus.emit


class ClientGone(Exception):
    """The client of a stream left: nothing to migrate, nobody to tell."""


async def write(resp: web.StreamResponse, data: bytes) -> None:
    """Write to the client; its hang-up is ClientGone, never mistaken for a cut upstream."""
    try:
        await resp.write(data)
    except (ConnectionError, aiohttp.ClientConnectionError, RuntimeError) as e:
        raise ClientGone(str(e)) from e


class Refused(Exception):
    """A continuation was answered with an error status instead of a stream."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


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


class PrimaryView:
    """The current primary, whether it acknowledged its promotion, and the next one."""

    ACK_WAIT_S = 1.0  # forward anyway if an engine does not acknowledge by then

    def __init__(self) -> None:
        self.target: Target | None = None
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


class Router:
    def __init__(
        self, spec: RouterSpec, view: PrimaryView, node: str = "", emit: Emit | None = None
    ) -> None:
        self.spec = spec
        self.view = view
        self.node = node  # this node's name in a cluster; "" alone
        self.emit = emit  # events (router.<node or main>.migrated, ...) go to the bus
        self.forwarded = 0
        self.retried = 0
        self.failed = 0
        self.broken = 0
        self.migrations = dict.fromkeys(("attempted", "succeeded", "failed"), 0)
        self.stalls = Stalls()
        self.stopping = False
        self.in_flight = 0
        self._stopped = asyncio.Event()
        # upstream streams by the local primary's epoch: cut at once when another is routed
        self._upstreams: dict[int, set[aiohttp.ClientResponse]] = {}
        view.on_set(self._superseded)
        self._session: aiohttp.ClientSession | None = None

    def _superseded(self, target: Target | None) -> None:
        """The primary changed: a primary is replaced only once fenced, so the streams
        still read from an older one are cut now (and migrated), not when its sockets
        close, which the kernel does only after tearing down the dead process's memory."""
        for epoch in [e for e in self._upstreams if target is None or e < target.epoch]:
            for up in self._upstreams.pop(epoch):
                up.close()

    def stop(self) -> None:
        """From now on new requests get 503 at once; those under way go on."""
        self.stopping = True
        self._stopped.set()  # requests waiting for a primary give up now

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        app.on_cleanup.append(self._close)
        return app

    async def _close(self, _: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            timeout = aiohttp.ClientTimeout(total=self.spec.upstream_timeout_s, connect=2.0)
            self._session = aiohttp.ClientSession(
                timeout=timeout,
                auto_decompress=False,
                connector=aiohttp.TCPConnector(limit=0, force_close=False),
            )
        return self._session

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if self.stopping:
            resp = error(503, "the supervisor is stopping; retry on the next one", "unavailable")
            resp.headers["Retry-After"] = str(STOPPING_RETRY_AFTER_S)
            return resp
        self.in_flight += 1
        try:
            return await self._handle(request)
        finally:
            self.in_flight -= 1

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            size = f" of {request.content_length} bytes" if request.content_length else ""
            return error(
                413,
                f"request body{size} is over the router's limit of {MAX_BODY} bytes",
                "invalid_request_error",
            )
        if FORWARDED_BY in request.headers and self.view.misdirected():
            return not_leader()
        deadline = time.monotonic() + self.spec.retry_deadline_s
        stream = migration.plan(request.method, request.path, body)
        if stream is not None:
            return await self._stream(request, stream, deadline)
        target = await self._first(deadline)
        tries = attempts(self.spec)
        reason = "no primary is serving"
        attempt = 0
        while attempt < tries:
            if target is None:
                break
            if not target.remote:
                await self.view.acked(deadline)
                target = self.view.route() or target
            try:
                if not self.view.valid(target) or (
                    target.remote and FORWARDED_BY in request.headers
                ):
                    raise NotLeader(f"{target.node or target.name} is not leading here")
                return await self._forward(request, body, target)
            except UPSTREAM_ERRORS as e:
                if isinstance(e, NotLeader) and FORWARDED_BY in request.headers:
                    return not_leader()  # the router that sent it retries on the next leader
                reason = f"primary {target.name} failed before answering: {type(e).__name__}"
                if isinstance(e, NotLeader) and target.remote:
                    # the node this one sees as leader may not know it yet (its campaign's
                    # reply races the watch here), or its term is over: either way not a
                    # failed try; the same term again a moment later, or the next one
                    target = await self.view.again(target, deadline, NOT_LEADER_WAIT_S)
                    continue
                attempt += 1
                if attempt < tries:
                    self.retried += 1
                    target = await self._next(target.epoch, deadline)
        self.failed += 1
        log.warning("route_failed", path=request.path, error=reason)
        return error(502, reason, "upstream_error")

    async def _forward(
        self, request: web.Request, body: bytes, target: Target
    ) -> web.StreamResponse:
        sent: list[web.StreamResponse] = []  # the response, once its first byte went out
        try:
            async with self.view.serving(target):
                return await self._relay(request, body, target, sent)
        except LeadershipEnded:
            if not sent:
                raise NotLeader(f"the term of {target.node} ended before an answer") from None
            self.broken += 1
            log.warning("stream_cut", engine=target.name, node=target.node, why="term ended")
            if request.transport is not None:
                request.transport.abort()  # the client sees a cut, not a short answer
            return sent[0]

    async def _relay(
        self, request: web.Request, body: bytes, target: Target, sent: list[web.StreamResponse]
    ) -> web.StreamResponse:
        url = f"http://{target.host}:{target.port}{request.rel_url}"
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        if target.remote:
            headers[FORWARDED_BY] = self.node or "-"
        async with self._client().request(
            request.method, url, headers=headers, data=body, allow_redirects=False
        ) as up:
            if target.remote and up.status == 421 and NOT_LEADER in up.headers:
                raise NotLeader(f"{target.name} answered that it does not lead")
            resp = web.StreamResponse(status=up.status, reason=up.reason)
            for k, v in up.headers.items():
                if k.lower() not in HOP_BY_HOP and k.lower() != "content-encoding":
                    resp.headers.add(k, v)
            if "Content-Encoding" in up.headers:
                resp.headers["Content-Encoding"] = up.headers["Content-Encoding"]
            if not target.remote:  # another router's response carries its own
                resp.headers["X-Holdfast-Engine"] = target.name
                resp.headers["X-Holdfast-Epoch"] = str(target.epoch)
                if target.node:
                    resp.headers["X-Holdfast-Node"] = target.node
                    resp.headers["X-Holdfast-Cluster-Epoch"] = str(target.cluster_epoch)
            first = await up.content.readany()  # upstream failures up to here are retried
            await resp.prepare(request)
            sent.append(resp)
            self.forwarded += 1
            chunk = first
            try:
                while chunk:
                    await resp.write(chunk)
                    chunk = await up.content.readany()
                await resp.write_eof()
            except UPSTREAM_ERRORS as e:  # after the first byte: too late to retry
                self.broken += 1
                log.warning("stream_broken", engine=target.name, error=type(e).__name__)
                if request.transport is not None:
                    request.transport.abort()  # the client sees a cut, not a short answer
            return resp

    # ---- waiting for a primary ----
    async def _first(self, deadline: float) -> Target | None:
        return choose(self.view.route(), -1) or await self._next(-1, deadline)

    async def _next(self, epoch: int, deadline: float) -> Target | None:
        """`PrimaryView.next_after`, or None at once when the router stops."""
        if self.stopping:
            return None
        waiting = asyncio.ensure_future(self.view.next_after(epoch, deadline))
        stopped = asyncio.ensure_future(self._stopped.wait())
        try:
            await asyncio.wait([waiting, stopped], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            if not waiting.done():
                waiting.cancel()
        return None if waiting.cancelled() else waiting.result()

    # ---- streams, migrated when cut ----
    async def _stream(
        self, request: web.Request, st: Stream, deadline: float
    ) -> web.StreamResponse:
        """A streamed request: relayed chunk by chunk, and continued on the next primary
        when cut (token replay), up to router.migration_limit times."""
        sent: list[web.StreamResponse] = []  # the client's response, once prepared
        target = await self._first(deadline)
        tries, attempt = attempts(self.spec), 0
        reason = "no primary is serving"
        while target is not None:
            if not target.remote:
                await self.view.acked(deadline)
                target = self.view.route() or target
            try:
                if not self.view.valid(target) or (
                    target.remote and FORWARDED_BY in request.headers
                ):
                    raise NotLeader(f"{target.node or target.name} is not leading here")
                async with self.view.serving(target):
                    return await self._stream_once(request, st, target, sent)
            except ClientGone:
                log.info("client went away", stream=True, tokens=len(st.emitted))
                return sent[0]
            except Refused as e:
                if e.status == 503 and time.monotonic() < deadline:  # busy: ask again
                    await asyncio.sleep(BUSY_WAIT_S)
                    continue
                reason = f"the continuation on {target.name} was refused: {e}"
                break
            except CUT as e:
                if isinstance(e, NotLeader) and FORWARDED_BY in request.headers and not sent:
                    return not_leader()
                reason = f"primary {target.name} failed: {type(e).__name__}"
                if isinstance(e, NotLeader) and target.remote and not sent:
                    target = await self.view.again(target, deadline, NOT_LEADER_WAIT_S)
                    continue
                if not sent or not st.wrote:  # nothing reached the client: a plain retry
                    attempt += 1
                    if attempt >= tries:
                        break
                    self.retried += 1
                    target = await self._next(target.epoch, deadline)
                    continue
                if st.complete():  # the cut came after the last token
                    return await self._finish(sent[0], st)
                why = self._unmigratable(st)
                if why:
                    reason = f"{reason}; {why}"
                    break
                self._migrating(st, target, reason)
                deadline = time.monotonic() + self.spec.retry_deadline_s
                failed_epoch = target.epoch
                target = await self._next(failed_epoch, deadline)
                if target is None:
                    reason = (
                        f"{reason}; no primary took over within router.retry_deadline_s "
                        f"({self.spec.retry_deadline_s:g} s)"
                    )
        return await self._end_with_error(request, st, sent, reason)

    def _unmigratable(self, st: Stream) -> str:
        if self.stopping:
            return "the supervisor is stopping"
        if not st.can_continue():
            return "the engine's stream carries no token ids (return_token_ids)"
        if st.migrated >= self.spec.migration_limit:
            return f"router.migration_limit ({self.spec.migration_limit}) reached"
        return ""

    def _migrating(self, st: Stream, target: Target, reason: str) -> None:
        st.migrated += 1
        st.cut_at = st.last_token_at or time.monotonic()
        st.pending = True
        self.migrations["attempted"] += 1
        log.warning("stream_migrating", engine=target.name, tokens=len(st.emitted), why=reason)
        self._event("migrating", target.epoch, engine=target.name, tokens=len(st.emitted))

    def _resumed(self, st: Stream, tokens: int) -> None:
        """The first token after a cut reached the client: the stall it saw."""
        stall, st.cut_at = st.last_token_at - st.cut_at, 0.0
        self.stalls.observe(stall)
        self._event("migrated", st.epoch, tokens=tokens, stall_ms=round(stall * 1e3, 2))

    def _event(self, event: str, epoch: int, **data: Any) -> None:
        if self.emit is not None:
            self.emit("router", self.node or "main", event, epoch, **data)

    async def _end_with_error(
        self, request: web.Request, st: Stream, sent: list[web.StreamResponse], reason: str
    ) -> web.StreamResponse:
        """The end of a stream that cannot go on: a 502 before any byte, else an error
        event and no [DONE]."""
        self.failed += 1
        log.warning("route_failed", path=request.path, error=reason)
        if st.pending:
            st.pending = False
            self.migrations["failed"] += 1
            self._event("migration-failed", 0, tokens=len(st.emitted), why=reason)
        if not sent:
            status = 503 if self.stopping else 502
            return error(status, reason, "unavailable" if self.stopping else "upstream_error")
        self.broken += 1
        resp = sent[0]
        with contextlib.suppress(ClientGone, *UPSTREAM_ERRORS):
            await write(resp, migration.error_event(reason))
            await resp.write_eof()
        return resp

    async def _finish(self, resp: web.StreamResponse, st: Stream) -> web.StreamResponse:
        for body in st.closing():
            await write(resp, migration.sse(body))
        await write(resp, migration.DONE)
        with contextlib.suppress(ConnectionError):
            await resp.write_eof()
        if st.pending:
            st.pending = False
            self.migrations["succeeded"] += 1
        return resp

    async def _stream_once(
        self, request: web.Request, st: Stream, target: Target, sent: list[web.StreamResponse]
    ) -> web.StreamResponse:
        """One upstream request of a stream: the original, or (after a cut) a continuation."""
        cont = bool(sent) and st.wrote > 0
        path = migration.COMPLETIONS if cont else str(request.rel_url)
        body = st.continuation() if cont else st.first_body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        headers["Content-Type"] = "application/json"
        headers.pop("Content-Encoding", None)
        if target.remote:
            headers[FORWARDED_BY] = self.node or "-"
        url = f"http://{target.host}:{target.port}{path}"
        st.epoch = target.epoch
        async with self._client().post(url, headers=headers, data=body) as up:
            if target.remote and up.status == 421 and NOT_LEADER in up.headers:
                raise NotLeader(f"{target.name} answered that it does not lead")
            if not target.remote:
                self._upstreams.setdefault(target.epoch, set()).add(up)
            try:
                return await self._answer(request, st, target, sent, up, cont)
            finally:
                live = self._upstreams.get(target.epoch)
                if live is not None:
                    live.discard(up)
                    if not live:
                        del self._upstreams[target.epoch]

    async def _answer(
        self,
        request: web.Request,
        st: Stream,
        target: Target,
        sent: list[web.StreamResponse],
        up: aiohttp.ClientResponse,
        cont: bool,
    ) -> web.StreamResponse:
        """Relay one upstream answer of a stream (see `_stream_once`)."""
        streaming = up.status == 200 and up.content_type == "text/event-stream"
        if not streaming and cont:
            raise Refused(up.status, (await up.read()).decode(errors="replace")[:500])
        if not sent:
            resp = self._response(up, target)
            if not streaming:  # an error answer, or not a stream after all: as it is
                first = await up.read()
                await resp.prepare(request)
                await resp.write(first)
                await resp.write_eof()
                self.forwarded += 1
                return resp
            first = await up.content.readany()  # failures up to here are retried
            await resp.prepare(request)
            sent.append(resp)
            self.forwarded += 1
            return await self._pump(up, sent[0], st, cont, bytearray(first))
        # an SSE comment (clients skip it) marks where the stream goes on elsewhere
        await write(sent[0], migration.MIGRATED)
        return await self._pump(up, sent[0], st, cont, bytearray())

    def _response(self, up: aiohttp.ClientResponse, target: Target) -> web.StreamResponse:
        resp = web.StreamResponse(status=up.status, reason=up.reason)
        for k, v in up.headers.items():
            if k.lower() not in HOP_BY_HOP and k.lower() != "content-encoding":
                resp.headers.add(k, v)
        if not target.remote:
            resp.headers["X-Holdfast-Engine"] = target.name
            resp.headers["X-Holdfast-Epoch"] = str(target.epoch)
        return resp

    async def _pump(
        self,
        up: aiohttp.ClientResponse,
        resp: web.StreamResponse,
        st: Stream,
        cont: bool,
        buf: bytearray,
    ) -> web.StreamResponse:
        """Relay upstream events to the client until `[DONE]` (StreamCut before it)."""
        while True:
            for raw in migration.events(buf):
                data = migration.data_of(raw)
                if data == b"[DONE]":
                    return await self._finish(resp, st)
                try:
                    obj = json.loads(data) if data is not None else None
                except ValueError:
                    obj = None
                if not isinstance(obj, dict):  # not a JSON chunk: through as it came
                    await write(resp, raw)
                    st.wrote += 1
                    continue
                if "error" in obj:  # the engine's own error end: through, then stop
                    await write(resp, raw)
                    await resp.write_eof()
                    self.broken += 1
                    return resp
                for body in st.reshape(obj) if cont else [obj]:
                    tokens = len(st.emitted)
                    st.seen(body)
                    await write(resp, raw if not cont else migration.sse(body))
                    st.wrote += 1
                    if st.cut_at and len(st.emitted) > tokens:
                        self._resumed(st, tokens)
            chunk = await up.content.readany()
            if not chunk:
                raise StreamCut("the upstream stream ended before data: [DONE]")
            buf += chunk
