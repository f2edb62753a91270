"""The frame server's refusal of another uid, with a real forked peer that switches uid."""

from __future__ import annotations

import json
import os
import select
import socket
import struct
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from cachedaemon import protocol
from cachedaemon.frameserver import REFUSED_SLOTS, FrameServer, Reply
from tests.as_user import as_user

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="switching uid needs root")
NOBODY = 65534
REFUSAL = f"peer uid {NOBODY} is not this server's uid 0; connect as that user"


def pong(msg: protocol._Msg, fds: list[int]) -> Reply:
    return protocol.Pong(pid=os.getpid(), fingerprint="f"), []


@pytest.fixture
def serve() -> Iterator[Callable[..., str]]:
    """Start a FrameServer on an abstract socket (no file modes: only SO_PEERCRED guards it)."""
    servers: list[FrameServer] = []

    def start(**kw: Any) -> str:
        name = f"\0holdfast-test-frameserver-{os.getpid()}-{len(servers)}"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(name)
        sock.listen(64)
        server = FrameServer(sock, pong, **kw)
        server.start()
        servers.append(server)
        return name

    yield start
    for server in servers:
        server.close()


def as_nobody(work: Callable[[], Any]) -> Any:
    """What `work` returns (or raises, as text) run in a forked child of uid 65534."""
    return as_user(NOBODY, work)


def test_a_refused_peer_slow_to_send_reads_the_explanation(serve: Callable[..., str]) -> None:
    path = serve(refused_read_timeout=30.0)

    def slow_peer() -> str:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(30)
        s.connect(path)
        # a peer descheduled between connect and send: it writes once the server has had
        # its chance to answer and hang up (or after 0.5 s of the server waiting)
        poller = select.poll()
        poller.register(s, select.POLLRDHUP)
        poller.poll(500)
        protocol.send(s, protocol.AttachRequest())
        reply, _ = protocol.recv(s)
        return getattr(reply, "message", type(reply).__name__)

    said = as_nobody(slow_peer)
    assert said == REFUSAL


def test_refused_peers_neither_hold_the_server_nor_take_its_slots(
    serve: Callable[..., str],
) -> None:
    path = serve(refused_read_timeout=3.0, max_connections=1)
    held_r, held_w = os.pipe()
    go_r, go_w = os.pipe()

    def answer(s: socket.socket) -> str:
        try:
            reply, _ = protocol.recv(s)
            return str(getattr(reply, "message", type(reply).__name__))
        except EOFError:
            return "closed"

    def hostile_peers() -> dict[str, list[str]]:
        silent = []
        for _ in range(REFUSED_SLOTS + 4):  # more than the refusal slots, all saying nothing
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(30)
            s.connect(path)
            silent.append(s)
        os.write(held_w, b"x")
        os.read(go_r, 1)
        said = {"silent": [answer(s) for s in silent], "bad": []}
        for request in (struct.pack(">I", 1 << 30), struct.pack(">I", 100) + b"x"):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(30)  # past the cap, and a frame never finished
                s.connect(path)
                s.sendall(request)
                said["bad"].append(answer(s))
        return said

    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        said: Any = "the child failed"
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            said = hostile_peers()
        except BaseException as e:
            said = f"{type(e).__name__}: {e}"
        finally:
            os.write(held_w, json.dumps(said).encode()[:60000])
            os._exit(0)
    try:
        assert os.read(held_r, 1) == b"x"
        # while they hold their connections, the one slot of this uid is free
        reply, _ = protocol.call(path, protocol.Ping())
        assert reply == protocol.Pong(pid=os.getpid(), fingerprint="f")
    finally:
        os.write(go_w, b"x")
    said = json.loads(os.read(held_r, 65536))
    os.waitpid(pid, 0)
    # each silent one hears why once the refusal's timeout passes, or is closed at once
    # when the refusal slots are taken; none holds on past its timeout (recv's 30 s)
    assert set(said["silent"]) <= {REFUSAL, "closed"}
    assert said["silent"].count(REFUSAL) >= REFUSED_SLOTS
    assert said["bad"] == [REFUSAL, REFUSAL]
