"""holdfast_contract.wire over socketpairs: the bytes of a frame, fds beside it, truncated,
oversized and silent peers, the incremental reader, and whether a socket answers."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from holdfast_contract import wire
from holdfast_contract.errors import ProtocolError

CAP = 1024
_open: list[socket.socket] = []


def pair(timeout: float | None = 5.0) -> tuple[socket.socket, socket.socket]:
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


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_frame_is_a_big_endian_length_then_the_body() -> None:
    assert wire.frame_of(b"abc", CAP) == b"\x00\x00\x00\x03abc"
    assert wire.frame_length(b"\x00\x00\x04\x00", CAP) == CAP


def test_round_trip_with_fds_on_the_first_byte() -> None:
    a, b = pair()
    r, w = os.pipe()
    try:
        wire.send_frame(a, wire.frame_of(b"hello", CAP), [w])
        body, fds = wire.recv_frame(b, max_frame=CAP, max_fds=2)
        assert body == b"hello" and len(fds) == 1
        os.write(fds[0], b"x")  # the received fd is the pipe's write end
        assert os.read(r, 1) == b"x"
        wire.close_fds(fds)
    finally:
        os.close(r)
        os.close(w)


@pytest.mark.parametrize(
    ("sent", "error"),
    [
        (b"\x00\x00", r"closed mid-frame header \(1/3 bytes\)"),
        (b"\x00\x00\x00\x05ab", r"closed mid-frame body \(2/5 bytes\)"),
    ],
)
def test_a_truncated_frame_names_where_it_was_cut(sent: bytes, error: str) -> None:
    a, b = pair()
    a.sendall(sent)
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(ProtocolError, match=error):
        wire.recv_frame(b, max_frame=CAP)


def test_an_oversized_frame_is_refused_from_its_header_alone() -> None:
    a, b = pair(timeout=None)  # were the body waited for, this would hang
    a.sendall(wire.HEADER.pack(CAP + 1))
    with pytest.raises(ProtocolError, match=f"a reply of {CAP + 1} bytes exceeds the {CAP}-byte"):
        wire.recv_frame(b, max_frame=CAP, what="reply")
    with pytest.raises(ProtocolError, match="exceeds"):
        wire.frame_of(b"x" * (CAP + 1), CAP)


def test_a_clean_close_is_eof_and_a_silent_peer_times_out() -> None:
    a, b = pair(timeout=0.2)
    with pytest.raises(ProtocolError, match="timed out waiting for a frame"):
        wire.recv_frame(b, max_frame=CAP)
    a.close()
    with pytest.raises(EOFError):
        wire.recv_frame(b, max_frame=CAP)


def test_too_many_fds_are_refused_and_none_is_kept() -> None:
    a, b = pair()
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        before = open_fds()
        wire.send_frame(a, wire.frame_of(b"x", CAP), [null] * 4)
        with pytest.raises(ProtocolError, match="more than 3 fds sent with one frame"):
            wire.recv_frame(b, max_frame=CAP, max_fds=3)
        assert open_fds() == before
        with pytest.raises(ProtocolError, match="at most 253"):
            wire.send_frame(a, b"\x00\x00\x00\x00", [null] * (wire.MAX_FDS + 1))
    finally:
        os.close(null)


def test_the_reader_returns_the_body_only_once_it_is_whole() -> None:
    a, b = pair()
    b.setblocking(False)
    reader = wire.FrameReader(max_frame=CAP, max_fds=3)
    frame = wire.frame_of(b"body", CAP)
    assert reader.feed(b) is None  # nothing arrived yet
    for i, byte in enumerate(frame):
        wire.send_frame(a, bytes([byte]), [a.fileno()] if i == 0 else ())
        got = reader.feed(b)
        assert got == (b"body" if i == len(frame) - 1 else None)
    assert len(reader.fds) == 1
    wire.close_fds(reader.fds)


def test_the_reader_refuses_an_oversized_header_and_a_close_mid_frame() -> None:
    a, b = pair()
    b.setblocking(False)
    big = wire.FrameReader(max_frame=CAP, max_fds=3)
    a.sendall(wire.HEADER.pack(CAP + 1))
    with pytest.raises(ProtocolError, match=f"exceeds the {CAP}-byte cap"):
        while big.feed(b) is None:
            pass
    a2, b2 = pair()
    b2.setblocking(False)
    cut = wire.FrameReader(max_frame=CAP, max_fds=3)
    a2.sendall(wire.frame_of(b"abc", CAP)[:-1])
    a2.close()
    with pytest.raises(EOFError, match="closed mid-frame"):
        while cut.feed(b2) is None:
            pass


def test_drop_frame_reads_one_frame_and_leaves_the_next() -> None:
    a, b = pair()
    a.sendall(wire.frame_of(b"x" * 100, CAP) + wire.frame_of(b"next", CAP))
    wire.drop_frame(b, max_frame=CAP)
    b.settimeout(5)
    assert wire.recv_frame(b, max_frame=CAP)[0] == b"next"


def test_a_socket_answers_unless_nothing_can_be_there(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    assert not wire.socket_answers(path)  # no file
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as bound:
        bound.bind(str(path))  # bound, not listening: connections are refused
        assert not wire.socket_answers(path)
    path.unlink()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(path))
        server.listen(0)
        assert wire.socket_answers(path)
        queued = []
        while True:  # fill the backlog of a server that accepts nobody
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.setblocking(False)
            queued.append(c)
            try:
                c.connect(str(path))
            except BlockingIOError:
                break
        try:  # a busy server is a live one: its socket must not be taken over
            assert wire.socket_answers(path, timeout=0.2)
        finally:
            for c in queued:
                c.close()


def test_free_port_can_be_bound() -> None:
    port = wire.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_free_port_is_drawn_below_the_ephemeral_range() -> None:
    """No outgoing connection can take a port below the kernel's ephemeral range between
    the draw and the listen (one of another test's did, with a port the kernel picked)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {wire.free_port() for _ in range(20)}
    assert all(max(1024, low - 16384) <= p < low for p in ports), (sorted(ports), low)
    assert len(ports) > 1  # drawn, not one fixed port
