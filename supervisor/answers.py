"""The client's side of a generation the router relays as a stream (supervisor/streams.py):
`SseAnswer` writes each chunk to a streamed request's client as it comes; `JsonAnswer`
writes nothing until the stream is done, then answers a non-streamed request with one
JSON body in the engine's own non-streamed shape, built from the chunks, migrated or not.
A stream that cannot be completed is, for the one, an error event and no `[DONE]`, for the
other a 502 (503 while the supervisor stops) in OpenAI's error shape: never an answer
cut short that looks whole."""

from __future__ import annotations

import contextlib
from typing import Any

import aiohttp
from aiohttp import web

from supervisor import migration
from supervisor.migration import Stream
from supervisor.routing import HOP_BY_HOP, UPSTREAM_ERRORS, Target, answered_by

HOLDFAST = "x-holdfast-"  # the router's own response headers


class ClientGone(Exception):
    """The client of a stream left: nothing to migrate, nobody to tell."""


async def write(resp: web.StreamResponse, data: bytes) -> None:
    """Write to the client; its hang-up is ClientGone, never mistaken for a cut upstream."""
    try:
        await resp.write(data)
    except (ConnectionError, aiohttp.ClientConnectionError, RuntimeError) as e:
        raise ClientGone(str(e)) from e


def stamp(headers: Any, target: Target) -> None:
    """The router's headers on an answer from a local primary (another node's router
    stamps its own)."""
    if not target.remote:
        answered_by(headers, target)


def as_it_came(up: aiohttp.ClientResponse, target: Target) -> web.StreamResponse:
    """A response with the upstream's status and headers, and the router's."""
    resp = web.StreamResponse(status=up.status, reason=up.reason)
    for k, v in up.headers.items():
        if k.lower() not in HOP_BY_HOP and k.lower() != "content-encoding":
            resp.headers.add(k, v)
    stamp(resp.headers, target)
    return resp


class SseAnswer:
    """A streamed request's client: every chunk as it comes."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.resp: web.StreamResponse | None = None

    @property
    def opened(self) -> bool:
        return self.resp is not None

    async def open(self, up: aiohttp.ClientResponse, target: Target) -> None:
        resp = as_it_came(up, target)
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
        await write(self._resp(), migration.MIGRATED)

    async def done(self, st: Stream) -> web.StreamResponse:
        resp = self._resp()
        for body in st.closing():
            await write(resp, migration.sse(body))
        await write(resp, migration.DONE)
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
        with contextlib.suppress(ClientGone, *UPSTREAM_ERRORS):
            await write(resp, migration.error_event(reason))
            await resp.write_eof()
        return resp


class JsonAnswer:
    """A non-streamed request's client: nothing until the end, then one JSON body."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.opened = False
        self.headers: dict[str, str] = {}

    async def open(self, up: aiohttp.ClientResponse, target: Target) -> None:
        self.opened = True
        self._headers(up, target)

    def _headers(self, up: aiohttp.ClientResponse, target: Target) -> None:
        """The router's headers of the primary answering now (it finishes the answer)."""
        self.headers = {k: v for k, v in up.headers.items() if k.lower().startswith(HOLDFAST)}
        stamp(self.headers, target)

    async def event(self, data: bytes) -> None:
        """Nothing to write: the stream's `Stream.seen` keeps what the answer needs."""

    async def resumed(self, up: aiohttp.ClientResponse, target: Target) -> None:
        self._headers(up, target)

    async def done(self, st: Stream) -> web.StreamResponse:
        st.closing()  # a finish_reason when every owed token came without one
        return web.json_response(body(st), headers=self.headers)

    async def engine_error(self, raw: bytes, error: Any) -> web.StreamResponse:
        return web.json_response({"error": error}, status=502, headers=self.headers)


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
