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
end. A non-streamed one that the stream can rebuild (one choice, no logprobs, echo, ...:
`migration.collectable`) is asked for as a stream, migrated the same way, and answered with
one JSON body at the end (supervisor/answers.py), or a 502 when it cannot be completed;
any other request is relayed as bytes, retried only before its first byte. Once the
supervisor stops (`stop()`), new requests get 503 with Retry-After at once and those under
way finish within the engines' stop grace.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import structlog
from aiohttp import web

from supervisor import migration
from supervisor.answers import as_it_came
from supervisor.kinds.base import TOKEN_IDS, StreamShape
from supervisor.migration import Stalls
from supervisor.policy import RouterSpec
from supervisor.routing import (
    FORWARDED_BY,
    HOP_BY_HOP,
    NOT_LEADER,
    NOT_LEADER_WAIT_S,
    UPSTREAM_ERRORS,
    Emit,
    LeadershipEnded,
    NotLeader,
    PrimaryView,
    Target,
    attempts,
    choose,
    error,
    gave_up,
    not_leader,
)
from supervisor.streams import NotAStream, StreamRelay
from supervisor.warming import Warmer

__all__ = ["LeadershipEnded", "NotLeader", "PrimaryView", "Router", "Target", "attempts", "choose"]

log = structlog.get_logger("supervisor.router")
MAX_BODY = 64 * 1024 * 1024  # bytes of one request body
STOPPING_RETRY_AFTER_S = 1  # Retry-After of the 503 a stopping router answers


class Router:
    def __init__(
        self,
        spec: RouterSpec,
        view: PrimaryView,
        node: str = "",
        emit: Emit | None = None,
        shape: StreamShape = TOKEN_IDS,
    ) -> None:
        self.spec = spec
        self.shape = shape  # where the engine kind's stream chunks carry token ids
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
        self.streams = StreamRelay(self)
        self.warmer = Warmer(spec.warm_every, view, self.client)
        self._session: aiohttp.ClientSession | None = None

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

    def client(self) -> aiohttp.ClientSession:
        if self._session is None:
            timeout = aiohttp.ClientTimeout(total=self.spec.upstream_timeout_s, connect=2.0)
            self._session = aiohttp.ClientSession(
                timeout=timeout,
                auto_decompress=False,
                connector=aiohttp.TCPConnector(limit=0, force_close=False),
            )
        return self._session

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if self.stopping and FORWARDED_BY in request.headers:
            return not_leader()  # the router that sent it retries on the next leader
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
        stream = migration.plan(request.method, request.path, body, self.shape)
        if stream is not None:
            try:
                return await self.streams.relay(request, stream, deadline)
            except NotAStream as e:  # a non-streamed request: sent again as it came
                log.debug("not_collected", path=request.path, why=str(e))
        target = await self.first(deadline)
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
                    target = await self.next_primary(target.epoch, deadline)
                    reason = gave_up(reason, self.spec) if target is None else reason
        self.failed += 1
        log.warning("route_failed", path=request.path, error=reason)
        if FORWARDED_BY in request.headers and (self.stopping or self.view.misdirected()):
            return not_leader()  # before any byte: the router that sent it goes on elsewhere
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
        async with self.client().request(
            request.method, url, headers=headers, data=body, allow_redirects=False
        ) as up:
            if target.remote and up.status == 421 and NOT_LEADER in up.headers:
                raise NotLeader(f"{target.name} answered that it does not lead")
            resp = as_it_came(up, target, lambda: self.view.valid(target))
            if "Content-Encoding" in up.headers:
                resp.headers["Content-Encoding"] = up.headers["Content-Encoding"]
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
    async def first(self, deadline: float) -> Target | None:
        return choose(self.view.route(), -1) or await self.next_primary(-1, deadline)

    async def next_primary(self, epoch: int, deadline: float) -> Target | None:
        """`PrimaryView.next_after`, or None at once when the router stops."""
        if self.stopping:
            return None
        now = choose(self.view.route(), epoch)
        if now is not None:  # (after a cut, the next primary is routed to already)
            return now
        waiting = asyncio.ensure_future(self.view.next_after(epoch, deadline))
        stopped = asyncio.ensure_future(self._stopped.wait())
        try:
            await asyncio.wait([waiting, stopped], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            if not waiting.done():
                waiting.cancel()
        return None if waiting.cancelled() else waiting.result()
