"""The daemon/keeper wire protocol over socketpairs: round trips, fds, bad frames."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from cachedaemon import protocol
from cachedaemon.errors import DaemonUnavailable
from holdfast_contract import wire
from holdfast_contract.errors import ProtocolError
from tests.holdfast_contract.test_wire import _close_sockets, pair  # noqa: F401  (the fixture closes pairs)


def test_round_trip_with_fds() -> None:
    a, b = pair()
    r, w = os.pipe()
    try:
        protocol.send(a, protocol.Reclaim("abc"), [w])
        msg, fds = protocol.recv(b, max_fds=4)
        assert msg == protocol.Reclaim("abc")
        assert len(fds) == 1
        os.write(fds[0], b"hi")  # the received fd is the pipe's write end
        assert os.read(r, 2) == b"hi"
        wire.close_fds(fds)
    finally:
        os.close(r)
        os.close(w)


def test_truncated_frame_is_an_error() -> None:
    a, b = pair()
    frame = protocol.encode(protocol.Ping())
    a.sendall(frame[:-1])
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(ProtocolError, match="closed mid-frame body"):
        protocol.recv(b)


def test_oversized_frame_is_refused_before_reading_it() -> None:
    a, b = pair()
    a.sendall(struct.pack(">I", protocol.MAX_FRAME + 1))
    with pytest.raises(ProtocolError, match="exceeds"):
        protocol.recv(b)


def test_garbage_is_an_error() -> None:
    a, b = pair()
    a.sendall(struct.pack(">I", 5) + b"\xc1\xc1\xc1\xc1\xc1")
    with pytest.raises(ProtocolError, match="undecodable"):
        protocol.recv(b)


def test_unknown_fields_and_tags_are_refused() -> None:
    import msgspec

    a, b = pair()
    body = msgspec.msgpack.encode({"type": "Reclaim", "fingerprint": "x", "evil": 1})
    a.sendall(struct.pack(">I", len(body)) + body)
    with pytest.raises(ProtocolError):
        protocol.recv(b)
    body = msgspec.msgpack.encode({"type": "Pickle", "data": "x"})
    a.sendall(struct.pack(">I", len(body)) + body)
    with pytest.raises(ProtocolError):
        protocol.recv(b)


def test_silent_peer_times_out() -> None:
    _a, b = pair(timeout=0.2)
    with pytest.raises(ProtocolError, match="timed out"):
        protocol.recv(b)


def test_clean_close_is_eof() -> None:
    a, b = pair()
    a.close()
    with pytest.raises(EOFError):
        protocol.recv(b)


def test_fds_sent_to_a_receiver_expecting_none_do_not_leak_into_the_frame() -> None:
    a, b = pair()
    r, w = os.pipe()
    try:
        protocol.send(a, protocol.Ping(), [w])
        msg, fds = protocol.recv(b, max_fds=0)  # kernel drops the fds with MSG_CTRUNC
        assert msg == protocol.Ping() and fds == []
    finally:
        os.close(r)
        os.close(w)


# call_async: the supervisor's ping, on the event loop


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def answering(reply: bytes | None) -> Handler:
    """A connection handler that reads one frame and writes `reply` (None: nothing)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            (length,) = wire.HEADER.unpack(await reader.readexactly(wire.HEADER.size))
            protocol.decode(await reader.readexactly(length))
            if reply is None:
                await reader.read()  # until the client gives up and closes
                return
            writer.write(reply)
            await writer.drain()
        finally:
            writer.close()

    return handle


def test_call_async_round_trip_and_its_errors(tmp_path: Path) -> None:
    pong = protocol.Pong(1234, "fp")

    async def ask(reply: bytes | None, timeout: float = 10.0) -> protocol._Msg:
        path = tmp_path / "d.sock"
        path.unlink(missing_ok=True)
        server = await asyncio.start_unix_server(answering(reply), str(path))
        try:
            return await protocol.call_async(str(path), protocol.Ping(), timeout=timeout)
        finally:
            server.close()

    async def main() -> None:
        assert await ask(protocol.encode(pong)) == pong
        with pytest.raises(ProtocolError, match="without a reply"):
            await ask(protocol.encode(pong)[:6])  # cut off mid-body
        with pytest.raises(ProtocolError, match="exceeds"):
            await ask(wire.HEADER.pack(protocol.MAX_FRAME + 1))
        with pytest.raises(ProtocolError, match="did not answer within 0.20 s"):
            await ask(None, timeout=0.2)
        with pytest.raises(DaemonUnavailable, match="nothing answers"):
            await protocol.call_async(str(tmp_path / "none.sock"), protocol.Ping(), timeout=1)

    asyncio.run(main())


def test_call_async_says_when_the_request_was_written(tmp_path: Path) -> None:
    """`on_sent` runs once the request is written and before any reply is read, and not
    at all when nothing answers: the supervisor counts a daemon's silence from then."""
    path = tmp_path / "d.sock"
    order: list[str] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        (length,) = wire.HEADER.unpack(await reader.readexactly(wire.HEADER.size))
        protocol.decode(await reader.readexactly(length))
        order.append("read by the daemon")
        writer.write(protocol.encode(protocol.Pong(1, "fp")))
        await writer.drain()
        writer.close()

    async def main() -> None:
        server = await asyncio.start_unix_server(handle, str(path))
        try:
            reply = await protocol.call_async(
                str(path), protocol.Ping(), timeout=10, on_sent=lambda: order.append("sent")
            )
        finally:
            server.close()
        assert reply == protocol.Pong(1, "fp") and order == ["sent", "read by the daemon"]
        order.clear()
        with pytest.raises(DaemonUnavailable):
            await protocol.call_async(
                str(tmp_path / "none.sock"), protocol.Ping(), on_sent=lambda: order.append("x")
            )
        assert order == []

    asyncio.run(main())
