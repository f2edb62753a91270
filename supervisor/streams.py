"""The router's relay of a streamed completion or chat completion: chunk by chunk to the
client, and, when the primary answering it dies or is fenced, continued on the next one by
token replay (supervisor/migration.py), at most `router.migration_limit` times. A stream
that cannot go on ends with an error event in OpenAI's shape and no `data: [DONE]`; one
that another node's router forwarded here, cut because this node stops, is handed back to
that router (its connection aborted), which continues it on the next leader."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import TYPE_CHECKING, Any

import aiohttp
import structlog
from aiohttp import web

from supervisor import migration
from supervisor.migration import Stream, StreamCut
from supervisor.routing import (
    FORWARDED_BY,
    HOP_BY_HOP,
    NOT_LEADER,
    NOT_LEADER_WAIT_S,
    UPSTREAM_ERRORS,
    LeadershipEnded,
    NotLeader,
    Target,
    answered_by,
    attempts,
    error,
    not_leader,
)

if TYPE_CHECKING:
    from supervisor.router import Router

log = structlog.get_logger("supervisor.router")
BUSY_WAIT_S = 0.01  # a continuation answered 503 (busy) is asked again this much later
CUT = (*UPSTREAM_ERRORS, StreamCut, LeadershipEnded)


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


class StreamRelay:
    """The streams of one `Router`, and the upstream answers they read, by epoch."""

    def __init__(self, router: Router) -> None:
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
        """A streamed request: relayed chunk by chunk, and continued on the next primary
        when cut (token replay), up to router.migration_limit times."""
        sent: list[web.StreamResponse] = []  # the client's response, once prepared
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
                    target = await self.r.view.again(target, deadline, NOT_LEADER_WAIT_S)
                    continue
                if not sent or not st.wrote:  # nothing reached the client: a plain retry
                    attempt += 1
                    if attempt >= tries:
                        break
                    self.r.retried += 1
                    target = await self.r.next_primary(target.epoch, deadline)
                    continue
                if st.complete():  # the cut came after the last token
                    return await self._finish(sent[0], st)
                if self.r.stopping and FORWARDED_BY in request.headers:
                    return self._hand_back(request, st, sent[0])
                why = self._unmigratable(st)
                if why:
                    reason = f"{reason}; {why}"
                    break
                self._migrating(st, target, reason)
                deadline = time.monotonic() + self.r.spec.retry_deadline_s
                failed_epoch = target.epoch
                target = await self.r.next_primary(failed_epoch, deadline)
                if target is None:
                    reason = (
                        f"{reason}; no primary took over within router.retry_deadline_s "
                        f"({self.r.spec.retry_deadline_s:g} s)"
                    )
        return await self._end_with_error(request, st, sent, reason)

    def _hand_back(
        self, request: web.Request, st: Stream, resp: web.StreamResponse
    ) -> web.StreamResponse:
        """A forwarded stream cut while this node stops: the router that forwarded it
        continues it on the next leader from what its own client has seen, so it gets a
        cut (the connection aborted), not an error event it would pass on as the end."""
        log.info("stream_handed_back", by=request.headers[FORWARDED_BY], tokens=len(st.emitted))
        if request.transport is not None:
            request.transport.abort()
        return resp

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
        log.warning("stream_migrating", engine=target.name, tokens=len(st.emitted), why=reason)
        self._event("migrating", target.epoch, engine=target.name, tokens=len(st.emitted))

    def _resumed(self, st: Stream, tokens: int) -> None:
        """The first token after a cut reached the client: the stall it saw."""
        stall, st.cut_at = st.last_token_at - st.cut_at, 0.0
        self.r.stalls.observe(stall)
        self._event("migrated", st.epoch, tokens=tokens, stall_ms=round(stall * 1e3, 2))

    def _event(self, event: str, epoch: int, **data: Any) -> None:
        if self.r.emit is not None:
            self.r.emit("router", self.r.node or "main", event, epoch, **data)

    async def _end_with_error(
        self, request: web.Request, st: Stream, sent: list[web.StreamResponse], reason: str
    ) -> web.StreamResponse:
        """The end of a stream that cannot go on: a 502 before any byte, else an error
        event and no [DONE]."""
        self.r.failed += 1
        log.warning("route_failed", path=request.path, error=reason)
        if st.pending:
            st.pending = False
            self.r.migrations["failed"] += 1
            self._event("migration-failed", 0, tokens=len(st.emitted), why=reason)
        if not sent:
            status = 503 if self.r.stopping else 502
            return error(status, reason, "unavailable" if self.r.stopping else "upstream_error")
        self.r.broken += 1
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
            self.r.migrations["succeeded"] += 1
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
            headers[FORWARDED_BY] = self.r.node or "-"
        url = f"http://{target.host}:{target.port}{path}"
        st.epoch = target.epoch
        async with self.r.client().post(url, headers=headers, data=body) as up:
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
                self.r.forwarded += 1
                return resp
            first = await up.content.readany()  # failures up to here are retried
            await resp.prepare(request)
            sent.append(resp)
            self.r.forwarded += 1
            return await self._pump(up, sent[0], st, cont, bytearray(first))
        # an SSE comment (clients skip it) marks where the stream goes on elsewhere
        await write(sent[0], migration.MIGRATED)
        return await self._pump(up, sent[0], st, cont, bytearray())

    def _response(self, up: aiohttp.ClientResponse, target: Target) -> web.StreamResponse:
        resp = web.StreamResponse(status=up.status, reason=up.reason)
        for k, v in up.headers.items():
            if k.lower() not in HOP_BY_HOP and k.lower() != "content-encoding":
                resp.headers.add(k, v)
        if not target.remote:  # another router's response carries its own
            answered_by(resp.headers, target)
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
                    self.r.broken += 1
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
