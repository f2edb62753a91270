"""The engine fork server's requests and replies, and the client that sends them.

A connection to the fork server's unix socket carries one `Spawn` (the engine's flags,
environment and working directory; stdin, stdout and stderr ride beside it as SCM_RIGHTS
file descriptors) and gets `Started(pid)` at once, or `Refused(message)`; `Exited(code)`
follows on the same connection when the engine ends. Each message is one frame of
`holdfast_contract.wire`: a length header, then a tagged msgpack struct. The server is
holdfast_fork's, run as `python -m engine.forkserver` (or, for vLLM,
`python -m holdfast_vllm.forkserver`); the supervisor starts it as a process and speaks to
it through this module only.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from pathlib import Path

import msgspec

from holdfast_contract import wire
from holdfast_contract.errors import ForkServerError, ProtocolError

MAX_FRAME = 1 << 20  # flags, environment and cwd of one engine; far more than any needs


class Spawn(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag=True):
    argv: list[str]  # the engine's flags: what follows `python -m engine`
    env: dict[str, str]
    cwd: str
    owner: int = 0  # a pid the engine dies with (0: none)


class Started(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag=True):
    pid: int


class Exited(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag=True):
    code: int  # like Popen.returncode: -N when killed by signal N


class Refused(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag=True):
    message: str


Reply = Started | Exited | Refused
_spawn_decoder = msgspec.msgpack.Decoder(Spawn)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_encode = msgspec.msgpack.Encoder().encode


def frame(msg: Spawn | Started | Exited | Refused) -> bytes:
    """`msg` encoded, with its length header; ProtocolError past MAX_FRAME."""
    return wire.frame_of(_encode(msg), MAX_FRAME)


def decode_spawn(body: bytes) -> Spawn:
    """A request's body (after the header); raises msgspec.DecodeError on garbage."""
    return _spawn_decoder.decode(body)


def read_reply(sock: socket.socket) -> Started | Exited | Refused:
    """The next reply on a request's connection; ForkServerError once the server is gone."""
    try:
        body, _ = wire.recv_frame(sock, max_frame=MAX_FRAME, what="reply")
        reply: Started | Exited | Refused = _reply_decoder.decode(body)
        return reply
    except EOFError as e:
        raise ForkServerError("fork server connection: closed before a reply") from e
    except (OSError, ProtocolError, msgspec.DecodeError) as e:
        raise ForkServerError(f"fork server connection: {e}") from e


def request(
    path: str | Path, spawn: Spawn, fds: Sequence[int], timeout: float = 10.0
) -> tuple[socket.socket, int]:
    """Ask the fork server at `path` for an engine; (the open connection, the engine's pid).
    `Exited` arrives on the connection when the engine ends. ForkServerError if none answers
    or it refuses."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(str(path))
        wire.send_frame(sock, frame(spawn), fds)
        reply = read_reply(sock)
    except (OSError, ProtocolError, ForkServerError) as e:
        sock.close()
        raise ForkServerError(f"fork server at {path}: {e}") from e
    if not isinstance(reply, Started):
        sock.close()
        detail = reply.message if isinstance(reply, Refused) else str(reply)
        raise ForkServerError(f"fork server at {path} refused: {detail}")
    sock.settimeout(None)
    return sock, reply.pid
