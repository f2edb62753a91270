"""The router's relay of a completion or chat completion as a stream: chunk by chunk to a
streamed request's client, or collected into one JSON body for a non-streamed one
(supervisor/proxy/answers.py); when the primary answering it dies or is fenced, continued
on the next one by token replay (supervisor/proxy/migration.py), at most
`router.migration_limit` times. A stream that cannot go on ends with an error event in
OpenAI's shape and no `data: [DONE]`; a collected one with a 502 (503 while stopping) in
the same shape. One that another node's router forwarded here, cut because this node
stops, is handed back to that router (its connection aborted), which continues it on the
next leader. A collected request the engine does not answer with an OpenAI stream comes
back as `NotAStream`: the router sends it again as the client sent it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import structlog
from aiohttp import web

from supervisor.primary import LeadershipEnded, Target
from supervisor.proxy import migration, sse
from supervisor.proxy.answers import Answer, ClientGone, JsonAnswer, SseAnswer, as_it_came
from supervisor.proxy.migration import Stream, StreamCut
from supervisor.proxy.routing import (
    FORWARDED_BY,
    UPSTREAM_ERRORS,
    Events,
    NotLeader,
    Routes,
    Tally,
    Tries,
    error,
    gave_up,
    not_leader,
    refuse_if_not_leading,
)
from supervisor.proxy.warming import Warmer

log = structlog.get_logger("supervisor.router")
BUSY_WAIT_S = 0.01  # a continuation answered 503 (busy) is asked again this much later
CUT = (*UPSTREAM_ERRORS, StreamCut, LeadershipEnded)


@dataclass(frozen=True)
class NotAStream:
    """The engine answered a collected request with something other than an OpenAI stream
    (an error, its own non-streamed body, another format): the request goes again as the
    client sent it, relayed as bytes."""

    why: str


Relayed = web.StreamResponse | NotAStream


class Refused(Exception):
    """A continuation was answered with an error status instead of a stream."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Flight:
    """One request relayed as a stream: its stream so far, its client's answer, its tries."""

    request: web.Request
    st: Stream
    out: Answer
    tries: Tries


@dataclass(eq=False)
class StreamRelay:
    """The streams of one router, and the upstream answers they read, by epoch: sent where
    `routes` says, on `client()`'s session, their pasts kept warm by `warmer`, counted in
    `tally`, their migrations told to `events`."""

    routes: Routes
    client: Callable[[], aiohttp.ClientSession]
    warmer: Warmer
    tally: Tally
    events: Events
    # upstream streams by the local primary's epoch: cut at once when another is routed
    _upstreams: dict[int, set[aiohttp.ClientResponse]] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.routes.view.on_set(self._superseded)

    def _superseded(self, target: Target | None) -> None:
        """The primary changed: a primary is replaced only once fenced, so the streams
        still read from an older one are cut now (and migrated), not when its sockets
        close, which the kernel does only after tearing down the dead process's memory."""
        for epoch in [e for e in self._upstreams if target is None or e < target.epoch]:
            for up in self._upstreams.pop(epoch):
                up.close()

    async def relay(self, request: web.Request, st: Stream, deadline: float) -> Relayed:
        """A generation as a stream: relayed chunk by chunk (or collected), and continued
        on the next primary when cut (token replay), up to router.migration_limit times."""
        try:
            return await self._relay(request, st, deadline)
        finally:
            self.warmer.ended(st)

    async def _relay(self, request: web.Request, st: Stream, deadline: float) -> Relayed:
        holds = self.routes.view.valid
        out: Answer = JsonAnswer(request, holds) if st.collect else SseAnswer(request, holds)
        f = Flight(request, st, out, self.routes.tries(request, deadline))
        self.warmer.arrived(st)
        answer = await f.tries.run(
            lambda target: self._send(f, target),
            lambda e, target: self._failed(f, e, target),
            (ClientGone, Refused, *CUT),
        )
        if answer is not None:
            return answer
        return await self._end_with_error(f)

    async def _send(self, f: Flight, target: Target) -> Relayed:
        async with self.routes.view.serving(target):
            return await self._stream_once(f, target)

    async def _failed(self, f: Flight, e: Exception, target: Target) -> Relayed | Target | None:
        """After a try of `f` failed: the answer to give, where to try next, or None."""
        if isinstance(e, ClientGone):  # (raised by a streamed client's writes only)
            log.info("client went away", stream=True, tokens=len(f.st.emitted))
            return _response(f.out)
        if isinstance(e, Refused):
            if e.status == 503 and time.monotonic() < f.tries.deadline:  # busy: ask again
                await asyncio.sleep(BUSY_WAIT_S)
                return target
            f.tries.reason = f"the continuation on {target.name} was refused: {e}"
            return None
        return await self._cut(f, e, target)

    async def _cut(self, f: Flight, e: Exception, target: Target) -> Relayed | Target | None:
        """A try of `f` cut (CUT): retried, migrated, finished, handed back, or given up."""
        if f.out.cut:  # bytes went out under a term that then ended: aborted
            return self._aborted(f)
        ended = isinstance(e, (NotLeader, LeadershipEnded))  # the term, not the engine
        if ended and f.tries.forwarded and not f.out.sent:
            return not_leader()  # the router that sent it goes on on the next leader
        f.tries.reason = f"primary {target.name} failed: {type(e).__name__}"
        if target.remote and (ended and not f.out.opened or f.st.pending and f.st.cut_at):
            # nothing of this try reached the client, and that node's term is over
            # as seen here, or it said so, or it did not take the continuation:
            # the same term again a moment later (it may resume it), or the next
            again = await f.tries.again(target)
            if again is None and f.st.pending:
                f.tries.reason = gave_up(f.tries.reason, self.routes.spec)
            return again
        if f.st.collect and (not f.st.can_continue() or ended and f.st.complete()):
            # no ids: asked again, whole; or all of it came, but its term ended
            # before it left: nothing reached the client, so it is made again
            f.st, f.out = f.st.fresh(), JsonAnswer(f.request, self.routes.view.valid)
        if not f.out.opened or not f.st.wrote:  # nothing came through: a plain retry
            return await f.tries.retry(target)
        if f.st.collect:
            f.st.rewind()  # its client has seen nothing: held-back text is made again
        if f.st.complete():  # the cut came after the last token
            try:
                return await self._finish(f.out, f.st)
            except LeadershipEnded:
                return self._aborted(f)
        if (self.routes.stopping or ended) and f.tries.forwarded:
            return self._hand_back(f)
        why = self._unmigratable(f.st)
        if why:
            f.tries.reason = f"{f.tries.reason}; {why}"
            return None
        self._migrating(f.st, target, f.tries.reason)
        return await f.tries.follow(target)

    def _aborted(self, f: Flight) -> web.StreamResponse:
        """An answer cut because its term ended as it was leaving: the client (or the
        router that forwarded it) sees the connection aborted, and retries."""
        self.tally.broken += 1
        log.warning("answer_cut", why="term ended", path=f.request.path)
        if f.request.transport is not None:
            f.request.transport.abort()
        return _response(f.out)

    def _hand_back(self, f: Flight) -> web.StreamResponse:
        """A forwarded stream cut while this node stops or its term ends: the router that
        forwarded it continues it on the next leader from what its own client has seen, so
        it gets a cut (the connection aborted), not an error event it would pass on as the
        end."""
        by = f.request.headers[FORWARDED_BY]
        log.info("stream_handed_back", by=by, tokens=len(f.st.emitted))
        if f.request.transport is not None:
            f.request.transport.abort()
        return _response(f.out)

    def _unmigratable(self, st: Stream) -> str:
        spec = self.routes.spec
        if self.routes.stopping:
            return "the supervisor is stopping"
        if not st.can_continue():
            return "the engine's stream carries no token ids (return_token_ids)"
        if st.migrated >= spec.migration_limit:
            return f"router.migration_limit ({spec.migration_limit}) reached"
        return ""

    def _migrating(self, st: Stream, target: Target, reason: str) -> None:
        st.migrated += 1
        st.cut_at = st.last_token_at or time.monotonic()
        st.pending = True
        self.tally.migrations["attempted"] += 1
        # its log line is the event's: a failover cuts every stream at once, and each line
        # logged then delays the continuations
        self.events(
            "migrating", target.epoch, engine=target.name, tokens=len(st.emitted), why=reason
        )

    def _resumed(self, st: Stream, tokens: int) -> None:
        """The first token after a cut reached the client: the stall it saw, and how many
        tokens of its past the engine had kept warm (`kept`; the rest it computed)."""
        stall, st.cut_at = st.last_token_at - st.cut_at, 0.0
        self.tally.stalls.observe(stall)
        stall_ms = round(stall * 1e3, 2)
        self.events("migrated", st.epoch, tokens=tokens, kept=st.kept, stall_ms=stall_ms)

    async def _end_with_error(self, f: Flight) -> web.StreamResponse:
        """The end of a stream that cannot go on: a 502 (503 while stopping) before any byte
        or to a collected request, else an error event and no [DONE]."""
        st, out, reason = f.st, f.out, f.tries.reason
        self.tally.failed += 1
        log.warning("route_failed", path=f.request.path, error=reason)
        if st.pending:
            st.pending = False
            self.tally.migrations["failed"] += 1
            self.events("migration-failed", 0, tokens=len(st.emitted), why=reason)
        if isinstance(out, SseAnswer) and out.opened:
            self.tally.broken += 1
            return await out.failed(reason)
        stopping = self.routes.stopping
        status = 503 if stopping else 502
        return error(status, reason, "unavailable" if stopping else "upstream_error")

    async def _finish(self, out: Answer, st: Stream) -> web.StreamResponse:
        resp = await out.done(st)
        if st.pending:
            st.pending = False
            self.tally.migrations["succeeded"] += 1
        return resp

    async def _stream_once(self, f: Flight, target: Target) -> Relayed:
        """One upstream request of a stream: the original, or (after a cut) a continuation."""
        st, request = f.st, f.request
        cont = f.out.opened and st.wrote > 0
        path = migration.COMPLETIONS if cont else str(request.rel_url)
        key = self.warmer.key_for(st, target) if cont else ""
        st.kept = st.warmed if key else 0
        body = st.continuation(key) if cont else st.first_body()
        headers = self.routes.headers(request, target)
        headers["Content-Type"] = "application/json"
        headers.pop("Content-Encoding", None)
        url = f"http://{target.host}:{target.port}{path}"
        st.epoch = target.epoch
        async with self.client().post(url, headers=headers, data=body) as up:
            refuse_if_not_leading(up, target)
            if not target.remote:
                self._upstreams.setdefault(target.epoch, set()).add(up)
            try:
                return await self._answer(f, target, up, cont)
            finally:
                live = self._upstreams.get(target.epoch)
                if live is not None:
                    live.discard(up)
                    if not live:
                        del self._upstreams[target.epoch]

    async def _answer(
        self, f: Flight, target: Target, up: aiohttp.ClientResponse, cont: bool
    ) -> Relayed:
        """Relay one upstream answer of a stream (see `_stream_once`)."""
        streaming = up.status == 200 and up.content_type == "text/event-stream"
        if not streaming and cont:
            raise Refused(up.status, (await up.read()).decode(errors="replace")[:500])
        if f.out.opened:
            await f.out.resumed(up, target)  # the stream goes on elsewhere
            return await self._pump(f, up, cont, bytearray())
        if not streaming and f.st.collect:
            return NotAStream(f"{target.name} answered {up.status} {up.content_type}")
        if not streaming:  # an error answer, or not a stream after all: as it is
            resp = as_it_came(up, target, lambda: self.routes.view.valid(target))
            first = await up.read()
            await resp.prepare(f.request)
            await resp.write(first)
            await resp.write_eof()
            self.tally.forwarded += 1
            return resp
        first = await up.content.readany()  # failures up to here are retried
        await f.out.open(up, target)
        self.tally.forwarded += 1
        return await self._pump(f, up, cont, bytearray(first))

    async def _pump(
        self, f: Flight, up: aiohttp.ClientResponse, cont: bool, buf: bytearray
    ) -> Relayed:
        """Relay upstream events to the client until `[DONE]` (StreamCut before it)."""
        st, out = f.st, f.out
        while True:
            for raw in sse.events(buf):
                data = sse.data_of(raw)
                if data == b"[DONE]":
                    return await self._finish(out, st)
                obj = sse.json_of(data)
                if obj is None:  # not a JSON chunk: through as it came
                    if st.collect and data is not None and not st.wrote:
                        return NotAStream(f"the stream's first event is not JSON: {data[:80]!r}")
                    await out.event(raw)
                    st.wrote += 1
                    continue
                if "error" in obj:  # the engine's own error end: through, then stop
                    if isinstance(out, SseAnswer):
                        self.tally.broken += 1
                    else:
                        self.tally.failed += 1
                    return await out.engine_error(raw, obj["error"])
                for body in st.reshape(obj) if cont else [obj]:
                    await self._chunk(st, out, raw if not cont else sse.encode(body), body)
            chunk = await up.content.readany()
            if not chunk:
                raise StreamCut("the upstream stream ended before data: [DONE]")
            buf += chunk

    async def _chunk(self, st: Stream, out: Answer, raw: bytes, body: dict[str, Any]) -> None:
        """One chunk to the client, then into what it has seen."""
        tokens = len(st.emitted)
        await out.event(raw)
        st.seen(body)  # once it went out: a cut continues from what did
        st.wrote += 1
        if st.cut_at and len(st.emitted) > tokens:
            self._resumed(st, tokens)
        if len(st.emitted) > tokens:
            self.warmer.heard(st)


def _response(out: Answer) -> web.StreamResponse:
    """What a relay ended without an answer of its own returns to aiohttp."""
    return out.resp if isinstance(out, SseAnswer) and out.resp else web.Response()
