"""The router: an HTTP reverse proxy to the current epoch's primary, streaming through.

Requests go only to the primary of the current epoch. A request whose upstream fails before
the first response byte is retried once on the next primary, within the retry deadline; a
request that arrives while no primary serves waits for one within the same deadline.
The router's own errors (413, 502, 503) have the OpenAI error shape the engines use:
`{"error": {"message": ..., "type": ...}}`.

A streamed completion or chat completion cut after its first byte (the primary died or
was fenced) is migrated: continued on the next primary by token replay
(supervisor/proxy/migration.py), at most `router.migration_limit` times. A stream that cannot be
continued ends with an error event in the same shape and no `data: [DONE]`: never a clean
end. A non-streamed one that the stream can rebuild (one choice, no logprobs, echo, ...:
`migration.collectable`) is asked for as a stream, migrated the same way, and answered with
one JSON body at the end (supervisor/proxy/answers.py), or a 502 when it cannot be completed.
Any other request is relayed as it came: an answer that is not a stream is read whole
before its first byte goes out, so it is retried while its upstream fails before the last
byte (a node killed while it sends); a stream only before its first byte. Once the
supervisor stops (`stop()`), new requests get 503 with Retry-After at once and those under
way finish within the engines' stop grace.
"""

from __future__ import annotations

import time

import aiohttp
import structlog
from aiohttp import web

from supervisor.kinds.base import TOKEN_IDS, StreamShape
from supervisor.policy import RouterSpec
from supervisor.primary import LeadershipEnded, PrimaryView, Target
from supervisor.proxy import migration
from supervisor.proxy.answers import as_it_came
from supervisor.proxy.relay import StreamRelay
from supervisor.proxy.routing import (
    FORWARDED_BY,
    UPSTREAM_ERRORS,
    Emit,
    Events,
    NotLeader,
    Routes,
    Tries,
    error,
    not_leader,
    refuse_if_not_leading,
    refuse_if_superseded,
)
from supervisor.proxy.warming import Warmer

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
        *,
        kv_keys: bool = False,
    ) -> None:
        """`kv_keys`: the engines share their KV caches (engines.kv_adopt): every stream
        is sent under a key of its own, which its continuation names (warming.py)."""
        self.spec = spec
        self.shape = shape  # where the engine kind's stream chunks carry token ids
        self.view = view
        # `node`: this node's name in a cluster ("" alone); events
        # (router.<node or main>.migrated, ...) go to `emit`, the bus
        self.routes = Routes(spec, view, node)
        self.tally = self.routes.tally  # what GET /metrics reads
        self.in_flight = 0
        self.warmer = Warmer(spec.warm_every, view, self.client, kv_keys=kv_keys)
        self.streams = StreamRelay(
            self.routes, self.client, self.warmer, self.tally, Events(node, emit)
        )
        self._session: aiohttp.ClientSession | None = None

    def stop(self) -> None:
        """From now on new requests get 503 at once; those under way go on."""
        self.routes.stopped.set()  # requests waiting for a primary give up now

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
        stopping = self.routes.stopping
        if stopping and FORWARDED_BY in request.headers:
            return not_leader()  # the router that sent it retries on the next leader
        if stopping:
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
            relayed = await self.streams.relay(request, stream, deadline)
            if isinstance(relayed, web.StreamResponse):
                return relayed
            # a non-streamed request: sent again as it came
            log.debug("not_collected", path=request.path, why=relayed.why)
        tries = self.routes.tries(request, deadline)
        answer = await tries.run(
            lambda target: self._forward(request, body, target),
            lambda e, target: self._failed(tries, e, target),
            UPSTREAM_ERRORS,
        )
        if answer is not None:
            return answer
        self.tally.failed += 1
        log.warning("route_failed", path=request.path, error=tries.reason)
        if tries.forwarded and (self.routes.stopping or self.view.misdirected()):
            return not_leader()  # before any byte: the router that sent it goes on elsewhere
        return error(502, tries.reason, "upstream_error")

    async def _failed(
        self, tries: Tries, e: Exception, target: Target
    ) -> web.StreamResponse | Target | None:
        """After a plain request's upstream failed before answering: where it goes next."""
        if isinstance(e, NotLeader) and tries.forwarded:
            return not_leader()  # the router that sent it retries on the next leader
        tries.reason = f"primary {target.name} failed before answering: {type(e).__name__}"
        if isinstance(e, NotLeader) and target.remote:
            # the node this one sees as leader may not know it yet (its campaign's
            # reply races the watch here), or its term is over: either way not a
            # failed try; the same term again a moment later, or the next one
            return await tries.again(target)
        return await tries.retry(target)

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
            self.tally.broken += 1
            log.warning("stream_cut", engine=target.name, node=target.node, why="term ended")
            if request.transport is not None:
                request.transport.abort()  # the client sees a cut, not a short answer
            return sent[0]

    async def _relay(
        self, request: web.Request, body: bytes, target: Target, sent: list[web.StreamResponse]
    ) -> web.StreamResponse:
        url = f"http://{target.host}:{target.port}{request.rel_url}"
        headers = self.routes.headers(request, target)
        async with self.client().request(
            request.method, url, headers=headers, data=body, allow_redirects=False
        ) as up:
            refuse_if_not_leading(up, target)
            refuse_if_superseded(up, target, self.view)
            resp = as_it_came(up, target, lambda: self.view.valid(target))
            if "Content-Encoding" in up.headers:
                resp.headers["Content-Encoding"] = up.headers["Content-Encoding"]
            # upstream failures up to here are retried: a stream's before its first bytes;
            # an answer that is not a stream is read whole first, so one whose upstream
            # dies mid-answer (a node killed while it sends) is retried too, not cut
            if up.content_type == "text/event-stream":
                first = await up.content.readany()
            else:
                first = await up.read()
            await resp.prepare(request)
            sent.append(resp)
            self.tally.forwarded += 1
            chunk = first
            try:
                while chunk:
                    await resp.write(chunk)
                    chunk = await up.content.readany()
                await resp.write_eof()
            except UPSTREAM_ERRORS as e:  # after the first byte: too late to retry
                self.tally.broken += 1
                log.warning("stream_broken", engine=target.name, error=type(e).__name__)
                if request.transport is not None:
                    request.transport.abort()  # the client sees a cut, not a short answer
            return resp
