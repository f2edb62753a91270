"""Operator commands over `ipc://<run>/control`: status, promote, evict, restart, stop.

A zmq REQ client sends one tagged msgpack struct; the supervisor's ROUTER answers with one
`ControlReply` (the messages are `holdfast_contract.control`). The runtime dir is 0700 and the socket is created under umask 077, so only
our own uid can connect; a malformed request gets an error reply and is counted.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable

import msgspec
import zmq
import zmq.asyncio

from holdfast_contract.control import (
    ControlReply,
    ControlRequest,
    Request,
    decode_reply,
    decode_request,
    encode,
)
from supervisor.errors import ControlError

Handler = Callable[[Request], Awaitable[ControlReply]]


class ControlServer:
    """Answers control requests with the handler given to `serve`, which runs as one task
    owned by the supervisor."""

    def __init__(self, endpoint: str) -> None:
        self._ctx = zmq.asyncio.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(endpoint)
        self.malformed = 0

    async def serve(self, handler: Handler) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            if len(frames) != 3 or frames[1] != b"":
                self.malformed += 1
                continue
            ident, _, body = frames
            reply = await self._answer(handler, body)
            await self._sock.send_multipart([ident, b"", encode(reply)])

    async def _answer(self, handler: Handler, body: bytes) -> ControlReply:
        try:
            req = decode_request(body)
        except msgspec.DecodeError as e:
            self.malformed += 1
            return ControlReply(ok=False, message=f"malformed control request: {e}")
        try:
            return await handler(req)
        except ControlError as e:
            return ControlReply(ok=False, message=str(e))

    def close(self) -> None:
        self._sock.close(linger=0)


def _check_reachable(endpoint: str) -> None:
    path = endpoint.removeprefix("ipc://")
    try:
        os.stat(path)
    except FileNotFoundError:
        raise ControlError(
            f"no supervisor runs on {os.path.dirname(path)} (no control "
            "socket); start one with `supervisor run`, or pass the right "
            "--policy/--runtime-dir"
        ) from None
    except PermissionError:
        raise ControlError(
            f"{os.path.dirname(path)} is not yours (uid {os.getuid()} may not "
            "enter it); run this as the user who runs the supervisor"
        ) from None


def request(endpoint: str, req: ControlRequest, timeout: float = 5.0) -> ControlReply:
    """Send one request to the supervisor at `endpoint` and return its reply."""
    if endpoint.startswith("ipc://"):
        _check_reachable(endpoint)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout * 1000))
    sock.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))
    try:
        sock.connect(endpoint)
        sock.send(encode(req))
        return decode_reply(sock.recv())
    except zmq.Again as e:
        raise ControlError(
            f"no supervisor answered on {endpoint} within {timeout:.0f}s; "
            "is `supervisor run` up for this policy/--runtime-dir?"
        ) from e
    finally:
        sock.close(linger=0)
