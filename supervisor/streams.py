"""The router's relay of a completion or chat completion as a stream: chunk by chunk to a
streamed request's client, or collected into one JSON body for a non-streamed one
(supervisor/answers.py); when the primary answering it dies or is fenced, continued on the
next one by token replay (supervisor/migration.py), at most `router.migration_limit` times.
A stream that cannot go on ends with an error event in OpenAI's shape and no `data: [DONE]`;
a collected one with a 502 (503 while stopping) in the same shape. One that another node's
router forwarded here, cut because this node stops, is handed back to that router (its
connection aborted), which continues it on the next leader."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Protocol

import aiohttp
import structlog
from aiohttp import web

from supervisor import migration
from supervisor.answers import Answer, ClientGone, JsonAnswer, SseAnswer, as_it_came
from supervisor.migration import Stalls, Stream, StreamCut
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
    error,
    gave_up,
    not_leader,
)
from supervisor.warming import Warmer

log = structlog.get_logger("supervisor.router")
BUSY_WAIT_S = 0.01  # a continuation answered 503 (busy) is asked again this much later
CUT = (*UPSTREAM_ERRORS, StreamCut, LeadershipEnded)


class NotAStream(Exception):
    """The engine answered a collected request with something other than an OpenAI stream
    (an error, its own non-streamed body, another format): the request goes again as the
    client sent it, relayed as bytes."""


class Refused(Exception):
    """A continuation was answered with an error status instead of a stream."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Relaying(Protocol):
    """What a `StreamRelay` uses of its router (`router.Router`): where and when to send,
    and the counts it keeps."""

    spec: RouterSpec
    view: PrimaryView
    warmer: Warmer
    node: str
    emit: Emit | None
    stopping: bool
    stalls: Stalls
    forwarded: int
    retried: int
    failed: int
    broken: int
    migrations: dict[str, int]

    def client(self) -> aiohttp.ClientSession: ...

    async def first(self, deadline: float) -> Target | None: ...

    async def next_primary(self, epoch: int, deadline: float) -> Target | None: ...


class StreamRelay:
    """The streams of one `Router`, and the upstream answers they read, by epoch."""

    def __init__(self, router: Relaying) -> None:
        self.r = router
        # upstream streams by the local primary's epoch: cut at once when another is routed
        self._upstreams: dict[int, set[aiohttp.ClientResponse]] = {}
        router.view.on_set(self._superseded)

    def _superseded(self, target: Target | None) -> None:
        """The primary changed: a primary is replaced only once fenced, so the streams
        still read from an older one are cut now (and migrated), not when its sockets
        close, which the kernel does only after tearing down the dead process's memory."""
        for epoch in [e for e in self._upstreams if target is None or e < target.epoch]:
            for up in self._upstreams.pop(epoch):
                up.close()

    async def relay(self, request: web.Request, st: Stream, deadline: float) -> web.StreamResponse:
        """A generation as a stream: relayed chunk by chunk (or collected), and continued
        on the next primary when cut (token replay), up to router.migration_limit times."""
        try:
            return await self._relay(request, st, deadline)
        finally:
            self.r.warmer.ended(st)

    async def _relay(self, request: web.Request, st: Stream, deadline: float) -> web.StreamResponse:
        holds = self.r.view.valid
        out: Answer = JsonAnswer(request, holds) if st.collect else SseAnswer(request, holds)
        self.r.warmer.arrived(st)
        target = await self.r.first(deadline)
        tries, attempt = attempts(self.r.spec), 0
        reason = "no primary is serving"
        while target is not None:
            if not target.remote:
                await self.r.view.acked(deadline)
                target = self.r.view.route() or target
            try:
                if not self.r.view.valid(target) or (
                    target.remote and FORWARDED_BY in request.headers
                ):
                    raise NotLeader(f"{target.node or target.name} is not leading here")
                async with self.r.view.serving(target):
                    return await self._stream_once(request, st, target, out)
            except ClientGone:  # (raised by a streamed client's writes only)
                log.info("client went away", stream=True, tokens=len(st.emitted))
                return out.resp if isinstance(out, SseAnswer) and out.resp else web.Response()
            except Refused as e:
                if e.status == 503 and time.monotonic() < deadline:  # busy: ask again
                    await asyncio.sleep(BUSY_WAIT_S)
                    continue
                reason = f"the continuation on {target.name} was refused: {e}"
                break
            except CUT as e:
                if out.cut:  # bytes went out under a term that then ended: aborted
                    return self._aborted(request, out)
                ended = isinstance(e, (NotLeader, LeadershipEnded))  # the term, not the engine
                if ended and FORWARDED_BY in request.headers and not out.sent:
                    return not_leader()  # the router that sent it goes on on the next leader
                reason = f"primary {target.name} failed: {type(e).__name__}"
                if target.remote and (ended and not out.opened or st.pending and st.cut_at):
                    # nothing of this try reached the client, and that node's term is over
                    # as seen here, or it said so, or it did not take the continuation:
                    # the same term again a moment later (it may resume it), or the next
                    target = await self.r.view.again(target, deadline, NOT_LEADER_WAIT_S)
                    reason = (
                        gave_up(reason, self.r.spec) if target is None and st.pending else reason
                    )
                    continue
                if st.collect and (not st.can_continue() or ended and st.complete()):
                    # no ids: asked again, whole; or all of it came, but its term ended
                    # before it left: nothing reached the client, so it is made again
                    st, out = st.fresh(), JsonAnswer(request, holds)
                if not out.opened or not st.wrote:  # nothing came through: a plain retry
                    attempt += 1
                    if attempt >= tries:
                        break
                    self.r.retried += 1
                    target = await self.r.next_primary(target.epoch, deadline)
                    reason = gave_up(reason, self.r.spec) if target is None else reason
                    continue
                if st.collect:
                    st.rewind()  # its client has seen nothing: held-back text is made again
                if st.complete():  # the cut came after the last token
                    try:
                        return await self._finish(out, st)
                    except LeadershipEnded:
                        return self._aborted(request, out)
                if (self.r.stopping or ended) and FORWARDED_BY in request.headers:
                    return self._hand_back(request, st, out)
                why = self._unmigratable(st)
                if why:
                    reason = f"{reason}; {why}"
                    break
                self._migrating(st, target, reason)
                deadline = time.monotonic() + self.r.spec.retry_deadline_s
                target = await self._next(target, deadline)
                if target is None:
                    reason = gave_up(reason, self.r.spec)
        return await self._end_with_error(request, st, out, reason)

    async def _next(self, cut: Target, deadline: float) -> Target | None:
        """Where a cut stream goes on: after another node's router, that node again once
        it leads (it may resume the same term: its router continued or handed the stream
        back), or the next leader; after this node's primary, a later epoch."""
        if cut.remote:
            return await self.r.view.again(cut, deadline, NOT_LEADER_WAIT_S)
        return await self.r.next_primary(cut.epoch, deadline)

    def _aborted(self, request: web.Request, out: Answer) -> web.StreamResponse:
        """An answer cut because its term ended as it was leaving: the client (or the
        router that forwarded it) sees the connection aborted, and retries."""
        self.r.broken += 1
        log.warning("answer_cut", why="term ended", path=request.path)
        if request.transport is not None:
            request.transport.abort()
        return out.resp if isinstance(out, SseAnswer) and out.resp else web.Response()

    def _hand_back(self, request: web.Request, st: Stream, out: Answer) -> web.StreamResponse:
        """A forwarded stream cut while this node stops or its term ends: the router that forwarded it
        continues it on the next leader from what its own client has seen, so it gets a
        cut (the connection aborted), not an error event it would pass on as the end."""
        log.info("stream_handed_back", by=request.headers[FORWARDED_BY], tokens=len(st.emitted))
        if request.transport is not None:
            request.transport.abort()
        return out.resp if isinstance(out, SseAnswer) and out.resp else web.Response()

    def _unmigratable(self, st: Stream) -> str:
        if self.r.stopping:
            return "the supervisor is stopping"
        if not st.can_continue():
            return "the engine's stream carries no token ids (return_token_ids)"
        if st.migrated >= self.r.spec.migration_limit:
            return f"router.migration_limit ({self.r.spec.migration_limit}) reached"
        return ""

    def _migrating(self, st: Stream, target: Target, reason: str) -> None:
        st.migrated += 1
        st.cut_at = st.last_token_at or time.monotonic()
        st.pending = True
        self.r.migrations["attempted"] += 1
        # its log line is the event's: a failover cuts every stream at once, and each line
        # logged then delays the continuations
        self._event(
            "migrating", target.epoch, engine=target.name, tokens=len(st.emitted), why=reason
        )

    def _resumed(self, st: Stream, tokens: int) -> None:
        """The first token after a cut reached the client: the stall it saw, and how many
        tokens of its past the engine had kept warm (`kept`; the rest it computed)."""
        stall, st.cut_at = st.last_token_at - st.cut_at, 0.0
        self.r.stalls.observe(stall)
        stall_ms = round(stall * 1e3, 2)
        self._event("migrated", st.epoch, tokens=tokens, kept=st.kept, stall_ms=stall_ms)

    def _event(self, event: str, epoch: int, **data: Any) -> None:
        if self.r.emit is not None:
            self.r.emit("router", self.r.node or "main", event, epoch, **data)

    async def _end_with_error(
        self, request: web.Request, st: Stream, out: Answer, reason: str
    ) -> web.StreamResponse:
        """The end of a stream that cannot go on: a 502 (503 while stopping) before any byte
        or to a collected request, else an error event and no [DONE]."""
        self.r.failed += 1
        log.warning("route_failed", path=request.path, error=reason)
        if st.pending:
            st.pending = False
            self.r.migrations["failed"] += 1
            self._event("migration-failed", 0, tokens=len(st.emitted), why=reason)
        if isinstance(out, SseAnswer) and out.opened:
            self.r.broken += 1
            return await out.failed(reason)
        status = 503 if self.r.stopping else 502
        return error(status, reason, "unavailable" if self.r.stopping else "upstream_error")

    async def _finish(self, out: Answer, st: Stream) -> web.StreamResponse:
        resp = await out.done(st)
        if st.pending:
            st.pending = False
            self.r.migrations["succeeded"] += 1
        return resp

    async def _stream_once(
        self, request: web.Request, st: Stream, target: Target, out: Answer
    ) -> web.StreamResponse:
        """One upstream request of a stream: the original, or (after a cut) a continuation."""
        cont = out.opened and st.wrote > 0
        path = migration.COMPLETIONS if cont else str(request.rel_url)
        key = self.r.warmer.key_for(st, target) if cont else ""
        st.kept = st.warmed if key else 0
        body = st.continuation(key) if cont else st.first_body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        headers["Content-Type"] = "application/json"
        headers.pop("Content-Encoding", None)
        if target.remote:
            headers[FORWARDED_BY] = self.r.node or "-"
        url = f"http://{target.host}:{target.port}{path}"
        st.epoch = target.epoch
        async with self.r.client().post(url, headers=headers, data=body) as up:
            if target.remote and up.status == 421 and NOT_LEADER in up.headers:
                raise NotLeader(f"{target.name} answered that it does not lead")
            if not target.remote:
                self._upstreams.setdefault(target.epoch, set()).add(up)
            try:
                return await self._answer(request, st, target, out, up, cont)
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
        out: Answer,
        up: aiohttp.ClientResponse,
        cont: bool,
    ) -> web.StreamResponse:
        """Relay one upstream answer of a stream (see `_stream_once`)."""
        streaming = up.status == 200 and up.content_type == "text/event-stream"
        if not streaming and cont:
            raise Refused(up.status, (await up.read()).decode(errors="replace")[:500])
        if not out.opened:
            if not streaming and st.collect:
                raise NotAStream(f"{target.name} answered {up.status} {up.content_type}")
            if not streaming:  # an error answer, or not a stream after all: as it is
                resp = as_it_came(up, target, lambda: self.r.view.valid(target))
                first = await up.read()
                await resp.prepare(request)
                await resp.write(first)
                await resp.write_eof()
                self.r.forwarded += 1
                return resp
            first = await up.content.readany()  # failures up to here are retried
            await out.open(up, target)
            self.r.forwarded += 1
            return await self._pump(up, out, st, cont, bytearray(first))
        await out.resumed(up, target)  # the stream goes on elsewhere
        return await self._pump(up, out, st, cont, bytearray())

    async def _pump(
        self,
        up: aiohttp.ClientResponse,
        out: Answer,
        st: Stream,
        cont: bool,
        buf: bytearray,
    ) -> web.StreamResponse:
        """Relay upstream events to the client until `[DONE]` (StreamCut before it)."""
        while True:
            for raw in migration.events(buf):
                data = migration.data_of(raw)
                if data == b"[DONE]":
                    return await self._finish(out, st)
                try:
                    obj = json.loads(data) if data is not None else None
                except ValueError:
                    obj = None
                if not isinstance(obj, dict):  # not a JSON chunk: through as it came
                    if st.collect and data is not None and not st.wrote:
                        raise NotAStream(f"the stream's first event is not JSON: {data[:80]!r}")
                    await out.event(raw)
                    st.wrote += 1
                    continue
                if "error" in obj:  # the engine's own error end: through, then stop
                    if isinstance(out, SseAnswer):
                        self.r.broken += 1
                    else:
                        self.r.failed += 1
                    return await out.engine_error(raw, obj["error"])
                for body in st.reshape(obj) if cont else [obj]:
                    tokens = len(st.emitted)
                    await out.event(raw if not cont else migration.sse(body))
                    st.seen(body)  # once it went out: a cut continues from what did
                    st.wrote += 1
                    if st.cut_at and len(st.emitted) > tokens:
                        self._resumed(st, tokens)
                    if len(st.emitted) > tokens:
                        self.r.warmer.heard(st)
            chunk = await up.content.readany()
            if not chunk:
                raise StreamCut("the upstream stream ended before data: [DONE]")
            buf += chunk
