"""The client's side of what the router relays. Every answer leaves through `Released`,
which lets its bytes out only while the answering primary's term holds. Of a generation
relayed as a stream (supervisor/proxy/relay.py): `SseAnswer` writes each chunk to a
streamed request's client as it comes; `JsonAnswer` writes nothing until the stream is
done, then answers a non-streamed request with one JSON body in the engine's own
non-streamed shape, built from the chunks, migrated or not. A stream that cannot be
completed is, for the one, an error event and no `[DONE]`, for the other a 502 (503 while
the supervisor stops) in OpenAI's error shape: never an answer cut short that looks whole.
Any other answer goes as it came (`as_it_came`)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, MutableMapping
from typing import Any

import aiohttp
from aiohttp import web

from holdfast_contract.control import VERSION_HEADER
from supervisor.primary import LeadershipEnded, Target
from supervisor.proxy import sse
from supervisor.proxy.migration import Stream
from supervisor.proxy.routing import UPSTREAM_ERRORS, end_to_end

HOLDFAST = "x-holdfast-"  # the router's own response headers


class ClientGone(Exception):
    """The client of a stream left: nothing to migrate, nobody to tell."""


async def write(resp: web.StreamResponse, data: bytes) -> None:
    """Write to the client; its hang-up is ClientGone, never mistaken for a cut upstream."""
    try:
        await resp.write(data)
    except (ConnectionError, aiohttp.ClientConnectionError, RuntimeError) as e:
        raise ClientGone(str(e)) from e


def answered_by(headers: MutableMapping[str, str], target: Target) -> None:
    """The headers that say which engine (and, in a cluster, which node's term) answered:
    set by the router that forwarded to its local primary; another router's pass through."""
    headers["X-Holdfast-Engine"] = target.name
    headers["X-Holdfast-Epoch"] = str(target.epoch)
    if target.version and VERSION_HEADER not in headers:  # (an engine refitted says its own)
        headers[VERSION_HEADER] = target.version
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


def stamp(headers: Any, target: Target) -> None:
    """The router's headers on an answer from a local primary (another node's router
    stamps its own)."""
    if not target.remote:
        answered_by(headers, target)


def as_it_came(up: aiohttp.ClientResponse, target: Target, holds: Callable[[], bool]) -> Released:
    """A response with the upstream's status and headers, and the router's, whose bytes
    leave only while `holds()` (`Released`)."""
    resp = Released(holds, status=up.status, reason=up.reason)
    for k, v in end_to_end(up.headers.items()):
        if k.lower() != "content-encoding":
            resp.headers.add(k, v)
    stamp(resp.headers, target)
    return resp


Holds = Callable[[Target], bool]  # whether an answer from a target may leave now


class SseAnswer:
    """A streamed request's client: every chunk as it comes, while the term of the
    primary answering now holds (`Released`)."""

    def __init__(self, request: web.Request, holds: Holds) -> None:
        self.request = request
        self.holds = holds
        self.resp: Released | None = None
        self.target: Target | None = None  # answering now

    @property
    def opened(self) -> bool:
        return self.resp is not None

    @property
    def sent(self) -> bool:
        """Whether bytes of the answer went to the client."""
        return self.resp is not None

    @property
    def cut(self) -> bool:
        """Aborted: bytes had gone out under a term that ended before the rest could."""
        return self.resp is not None and self.resp.cut

    def _holds(self) -> bool:
        return self.target is not None and self.holds(self.target)

    async def open(self, up: aiohttp.ClientResponse, target: Target) -> None:
        self.target = target
        resp = as_it_came(up, target, self._holds)
        await resp.prepare(self.request)
        self.resp = resp

    def _resp(self) -> web.StreamResponse:
        if self.resp is None:
            raise RuntimeError("the answer is not open")
        return self.resp

    async def event(self, data: bytes) -> None:
        await write(self._resp(), data)

    async def resumed(self, up: aiohttp.ClientResponse, target: Target) -> None:
        """A continuation begins: an SSE comment (clients skip it) marks where."""
        self.target = target
        await write(self._resp(), sse.MIGRATED)

    async def done(self, st: Stream) -> web.StreamResponse:
        resp = self._resp()
        for body in st.closing():
            await write(resp, sse.encode(body))
        await write(resp, sse.DONE)
        with contextlib.suppress(ConnectionError):
            await resp.write_eof()
        return resp

    async def engine_error(self, raw: bytes, error: Any) -> web.StreamResponse:
        """The engine ended the stream with its own error event: through, then the end."""
        resp = self._resp()
        await write(resp, raw)
        await resp.write_eof()
        return resp

    async def failed(self, reason: str) -> web.StreamResponse:
        """An error event and no `[DONE]`: the client's reader raises."""
        resp = self._resp()
        with contextlib.suppress(ClientGone, LeadershipEnded, *UPSTREAM_ERRORS):
            await write(resp, sse.error_event(reason))
            await resp.write_eof()
        return resp


class JsonAnswer:
    """A non-streamed request's client: nothing until the end, then one JSON body. A
    chunk is taken into it only while the term of the primary that sent it holds, and
    the body leaves only while that of the primary answering last does."""

    def __init__(self, request: web.Request, holds: Holds) -> None:
        self.request = request
        self.holds = holds
        self.opened = False
        self.sent = self.cut = False  # nothing leaves before the end, and then all at once
        self.headers: dict[str, str] = {}
        self.target: Target | None = None

    def _holds(self) -> bool:
        return self.target is not None and self.holds(self.target)

    async def open(self, up: aiohttp.ClientResponse, target: Target) -> None:
        self.opened = True
        self._headers(up, target)

    def _headers(self, up: aiohttp.ClientResponse, target: Target) -> None:
        """The router's headers of the primary answering now (it finishes the answer)."""
        self.target = target
        self.headers = {k: v for k, v in up.headers.items() if k.lower().startswith(HOLDFAST)}
        stamp(self.headers, target)

    async def event(self, data: bytes) -> None:
        """Nothing to write (the stream's `Stream.seen` keeps what the answer needs), but
        a chunk made after its term is not taken."""
        if not self._holds():
            raise LeadershipEnded("the term ended before the chunk was taken")

    async def resumed(self, up: aiohttp.ClientResponse, target: Target) -> None:
        self._headers(up, target)

    async def done(self, st: Stream) -> web.StreamResponse:
        st.closing()  # a finish_reason when every owed token came without one
        out = body(st)
        version = self.headers.get(VERSION_HEADER) or (self.target and self.target.version)
        if version and st.fingerprint is None:
            out["system_fingerprint"] = version  # the model version that made it
        return await self._send(200, out)

    async def engine_error(self, raw: bytes, error: Any) -> web.StreamResponse:
        return await self._send(502, {"error": error})

    async def _send(self, status: int, content: Any) -> web.StreamResponse:
        resp = Released(self._holds, status=status)
        resp.headers.update(self.headers)
        resp.content_type = "application/json"
        data = json.dumps(content).encode()
        resp.content_length = len(data)
        await resp.prepare(self.request)
        self.sent = True
        try:
            await resp.write_eof(data)
        finally:
            self.cut = resp.cut
        return resp


Answer = SseAnswer | JsonAnswer


def body(st: Stream) -> dict[str, Any]:
    """A collected stream as the engine answers the same request not streamed: one choice
    with the whole text (and, for a completion, its token ids), usage over every token; the
    finishing choice's extra fields (vLLM's `stop_reason`) and `system_fingerprint` where
    the engine sent them."""
    text = "".join(st.text)
    choice: dict[str, Any]
    if st.chat:
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "logprobs": None}
        choice["finish_reason"] = st.finish_reason
    else:
        choice = {"index": 0, "text": text, "token_ids": list(st.emitted)}
        choice.update(finish_reason=st.finish_reason, logprobs=None)
    out = {
        "id": st.chunk_id,
        "object": "chat.completion" if st.chat else "text_completion",
        "created": st.created,
        "model": st.model,
        "choices": [{**choice, **st.finish_extra}],
        "usage": st.total_usage(),
    }
    if st.fingerprint is not None:
        out["system_fingerprint"] = st.fingerprint
    return out
