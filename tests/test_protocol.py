"""The daemon/keeper wire protocol over socketpairs: round trips, fds, bad frames."""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Iterator

import pytest

from cachedaemon import protocol
from cachedaemon.errors import ProtocolError

_open: list[socket.socket] = []


def pair(timeout: float = 1.0) -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.settimeout(timeout)
    b.settimeout(timeout)
    _open.extend((a, b))
    return a, b


@pytest.fixture(autouse=True)
def _close_sockets() -> Iterator[None]:
    yield
    while _open:
        _open.pop().close()


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
        protocol.close_fds(fds)
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
