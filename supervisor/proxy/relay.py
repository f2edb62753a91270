"""The router's relay of a completion or chat completion as a stream: chunk by chunk to a
streamed request's client, or collected into one JSON body for a non-streamed one
(supervisor/proxy/answers.py); when the primary answering it dies or is fenced, continued
on the next one by token replay (supervisor/proxy/migration.py), at most
`router.migration_limit` times. What becomes of a try that failed is decided in
supervisor/proxy/cuts.py: a stream that cannot go on ends with an error event in OpenAI's
shape and no `data: [DONE]`; a collected one with a 502 (503 while stopping) in the same
shape. One that another node's router forwarded here, cut because this node stops, is
handed back to that router (its connection aborted), which continues it on the next
leader. A collected request the engine does not answer with an OpenAI stream comes
back as `NotAStream`: the router sends it again as the client sent it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from holdfast_contract.control import KEPT_HEADER
from supervisor.primary import Target
from supervisor.proxy import migration, sse
from supervisor.proxy.answers import Answer, ClientGone, JsonAnswer, SseAnswer, as_it_came
from supervisor.proxy.cuts import CUT, Cuts, Flight, NotAStream, Refused, Relayed
from supervisor.proxy.migration import Stream, StreamCut
from supervisor.proxy.routing import (
    Events,
    Routes,
    Tally,
    refuse_if_not_leading,
    refuse_if_superseded,
)
from supervisor.proxy.warming import Warmer


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
    _versions: dict[int, str] = field(default_factory=dict, init=False)  # each epoch's version
    cuts: Cuts = field(init=False)  # what becomes of a try that failed

    def __post_init__(self) -> None:
        self.cuts = Cuts(self.routes, self.tally, self.events)
        self.routes.view.on_set(self._superseded)

    def _superseded(self, target: Target | None) -> None:
        """The primary changed: a primary is replaced only once fenced, so the streams
        still read from an older one are cut now (and migrated), not when its sockets
        close, which the kernel does only after tearing down the dead process's memory.
        A primary of another model version is not dead but superseded by a rolling
        update: its streams finish there (supervisor/update/)."""
        for epoch in [e for e in self._upstreams if target is None or e < target.epoch]:
            if target is not None and _superseded(self._versions.get(epoch, ""), target):
                continue
            self._versions.pop(epoch, None)
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
            lambda e, target: self.cuts.failed(f, e, target),
            (ClientGone, Refused, *CUT),
        )
        if answer is not None:
            return answer
        return await self.cuts.end_with_error(f)

    async def _send(self, f: Flight, target: Target) -> Relayed:
        async with self.routes.view.serving(target):
            return await self._stream_once(f, target)

    async def _stream_once(self, f: Flight, target: Target) -> Relayed:
        """One upstream request of a stream: the original, or (after a cut) a continuation."""
        st, request = f.st, f.request
        cont = f.out.opened and st.wrote > 0
        path = migration.COMPLETIONS if cont else str(request.rel_url)
        key = self.warmer.key_for(st, target) if cont else ""
        body = st.continuation(key) if cont else st.first_body()
        headers = self.routes.headers(request, target)
        headers["Content-Type"] = "application/json"
        headers.pop("Content-Encoding", None)
        url = f"http://{target.host}:{target.port}{path}"
        st.epoch = target.epoch
        async with self.client().post(url, headers=headers, data=body) as up:
            refuse_if_not_leading(up, target)
            refuse_if_superseded(up, target, self.routes.view)
            if not target.remote:
                self._upstreams.setdefault(target.epoch, set()).add(up)
                self._versions[target.epoch] = target.version
            try:
                return await self._answer(f, target, up, cont)
            finally:
                live = self._upstreams.get(target.epoch)
                if live is not None:
                    live.discard(up)
                    if not live:
                        del self._upstreams[target.epoch]
                        self._versions.pop(target.epoch, None)

    async def _answer(
        self, f: Flight, target: Target, up: aiohttp.ClientResponse, cont: bool
    ) -> Relayed:
        """Relay one upstream answer of a stream (see `_stream_once`)."""
        streaming = up.status == 200 and up.content_type == "text/event-stream"
        if not streaming and cont:
            raise Refused(up.status, (await up.read()).decode(errors="replace")[:500])
        if f.out.opened:
            # what the engine kept of its past: it says so (KEPT_HEADER) when it keeps
            # pasts, knowing it once the continuation ran (a past still on its way may
            # have been taken over, or not); an engine that does not say keeps none
            said = up.headers.get(KEPT_HEADER, "")
            f.st.kept = int(said) if said.isdigit() else 0
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
                    return await self.cuts.finish(out, st)
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
            self.cuts.resumed(st, tokens)
        if len(st.emitted) > tokens:
            self.warmer.heard(st)


def _superseded(version: str, target: Target) -> bool:
    """Whether streams from a primary of `version` are left to finish now that `target` is
    routed: a local primary of another model version took its place (a rolling update)."""
    return bool(version and target.version and not target.remote and version != target.version)
