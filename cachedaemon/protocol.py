"""Wire protocol of the daemon and the keeper: length-prefixed msgpack frames, fds beside them.

A frame is a 4-byte big-endian length and a msgspec msgpack body holding one tagged struct.
File descriptors travel as SCM_RIGHTS ancillary data on the first byte of the frame. No
pickle: every message is one of the structs below, decoded with `forbid_unknown_fields`.
This module imports neither torch nor anything that needs a GPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
import time
from typing import Any

import msgspec

from cachedaemon.config import CacheConfig
from cachedaemon.errors import ProtocolError
from cachedaemon.manifest import Manifest

MAX_FRAME = 64 * 1024 * 1024
MAX_FDS = 253  # SCM_MAX_FD on Linux
_HEADER = struct.Struct(">I")


class _Msg(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag=True):
    pass


# ---- client <-> daemon ----
class Ping(_Msg, frozen=True):
    pass


class Pong(_Msg, frozen=True):
    pid: int
    fingerprint: str


class AttachRequest(_Msg, frozen=True):
    config: CacheConfig | None = None  # None: take whatever the daemon serves


class AttachReply(_Msg, frozen=True):
    manifest: Manifest  # one fd per chunk travels with this frame, in chunk order


class Mismatch(_Msg, frozen=True):
    fields: list[str]
    served: CacheConfig


class StatusRequest(_Msg, frozen=True):
    pass


class StatusReply(_Msg, frozen=True):
    pid: int
    fingerprint: str
    backend: str
    device: str
    pool_bytes: int
    chunks: int
    tensors: int
    clients_attached: int
    clients_connected: int
    adopted: bool  # served from escrow, not from disk
    load_seconds: float
    config: CacheConfig


class ErrorReply(_Msg, frozen=True):
    message: str


# ---- daemon <-> keeper ----
class Deposit(_Msg, frozen=True):
    manifest: Manifest  # fds travel with this frame, in chunk order


class Reclaim(_Msg, frozen=True):
    fingerprint: str


class Withdraw(_Msg, frozen=True):
    fingerprint: str


class ListPools(_Msg, frozen=True):
    pass


class PoolInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    fingerprint: str
    pool_bytes: int
    chunks: int
    deposited_at: float
    reclaims: int


class Pools(_Msg, frozen=True):
    pools: list[PoolInfo]


class Reclaimed(_Msg, frozen=True):
    manifest: Manifest  # fds travel with this frame


class NotFound(_Msg, frozen=True):
    fingerprint: str


class Ok(_Msg, frozen=True):
    pass


Message = (
    Ping
    | Pong
    | AttachRequest
    | AttachReply
    | Mismatch
    | StatusRequest
    | StatusReply
    | ErrorReply
    | Deposit
    | Reclaim
    | Withdraw
    | ListPools
    | Pools
    | Reclaimed
    | NotFound
    | Ok
)

_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(Message)


def encode(msg: _Msg) -> bytes:
    return frame_of(_encoder.encode(msg))


def decode(body: bytes) -> _Msg:
    try:
        msg: _Msg = _decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"undecodable frame: {exc}") from exc
    return msg


def send(sock: socket.socket, msg: _Msg, fds: list[int] | tuple[int, ...] = ()) -> None:
    """Send one frame; fds (at most MAX_FDS) ride on its first byte."""
    send_frame(sock, encode(msg), fds)


def send_frame(sock: socket.socket, frame: bytes, fds: list[int] | tuple[int, ...] = ()) -> None:
    """Send an encoded frame (header included), fds on its first byte. Any msgspec body
    can travel this way; `send` is it for this module's messages."""
    if len(fds) > MAX_FDS:
        raise ProtocolError(f"{len(fds)} fds in one frame; at most {MAX_FDS}")
    if fds:
        sent = socket.send_fds(sock, [frame[:1]], list(fds))
        sock.sendall(frame[sent:])
    else:
        sock.sendall(frame)


def frame_of(body: bytes) -> bytes:
    """`body` with its length header."""
    if len(body) > MAX_FRAME:
        raise ProtocolError(f"frame of {len(body)} bytes exceeds the {MAX_FRAME}-byte cap")
    return _HEADER.pack(len(body)) + body


def frame_length(head: bytes, max_frame: int = MAX_FRAME) -> int:
    """The body length a frame header announces; ProtocolError past `max_frame`."""
    (length,) = _HEADER.unpack(head)
    if length > max_frame:
        raise ProtocolError(f"frame of {length} bytes exceeds the {max_frame}-byte cap")
    return int(length)


def _recv_exact(sock: socket.socket, n: int, what: str) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        try:
            part = sock.recv(n - len(buf))
        except TimeoutError as exc:
            raise ProtocolError(f"timed out reading the {what} ({len(buf)}/{n} bytes)") from exc
        if not part:
            raise ProtocolError(f"connection closed mid-{what} ({len(buf)}/{n} bytes)")
        buf += part
    return bytes(buf)


def recv(
    sock: socket.socket, *, max_fds: int = 0, max_frame: int = MAX_FRAME
) -> tuple[_Msg, list[int]]:
    """Receive one frame and the fds sent with it. Raises ProtocolError on a bad frame
    (fds that arrived are closed first) and EOFError on a clean close before any byte."""
    body, fds = recv_frame(sock, max_fds=max_fds, max_frame=max_frame)
    try:
        return decode(body), fds
    except BaseException:
        close_fds(fds)
        raise


def recv_frame(
    sock: socket.socket, *, max_fds: int = 0, max_frame: int = MAX_FRAME
) -> tuple[bytes, list[int]]:
    """One frame's body and the fds sent with it, undecoded; errors as `recv`."""
    fds: list[int] = []
    flags = 0
    try:
        if max_fds:
            first, fds, flags, _ = socket.recv_fds(sock, 1, max_fds)
        else:
            first = sock.recv(1)
    except TimeoutError as exc:
        raise ProtocolError("timed out waiting for a frame") from exc
    try:
        if flags & socket.MSG_CTRUNC:  # those that fit were installed: closed below
            raise ProtocolError(f"more than {max_fds} fds sent with one frame")
        if not first:
            raise EOFError("peer closed the connection")
        head = first + _recv_exact(sock, _HEADER.size - 1, "frame header")
        return _recv_exact(sock, frame_length(head, max_frame), "frame body"), fds
    except BaseException:
        close_fds(fds)
        raise


def drop_frame(sock: socket.socket, *, max_frame: int = MAX_FRAME, within: float = 1.0) -> None:
    """Read one frame of a peer that will be refused and drop it, so the refusal that follows
    reaches a peer that has finished sending. Gives up at EOF, at a header over `max_frame`
    or once `within` seconds have passed. Plain reads: fds sent with it are never installed."""
    deadline = time.monotonic() + within
    head = _read_until(sock, _HEADER.size, deadline)
    if len(head) < _HEADER.size or _HEADER.unpack(head)[0] > max_frame:
        return
    left = _HEADER.unpack(head)[0]
    while left > 0:
        got = len(_read_until(sock, min(left, 1 << 16), deadline))
        if got == 0:
            return
        left -= got


def _read_until(sock: socket.socket, n: int, deadline: float) -> bytes:
    """Up to `n` bytes read before `deadline`; fewer at EOF, timeout or a socket error."""
    buf = bytearray()
    while len(buf) < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            sock.settimeout(remaining)
            part = sock.recv(n - len(buf))
        except OSError:  # TimeoutError among them
            break
        if not part:
            break
        buf += part
    return bytes(buf)


def close_fds(fds: list[int] | tuple[int, ...]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a unix socket (SO_PEERCRED)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


def call(
    path: str,
    msg: _Msg,
    fds: list[int] | tuple[int, ...] = (),
    *,
    max_fds: int = 0,
    timeout: float = 10.0,
) -> tuple[_Msg, list[int]]:
    """One request, one reply, over a fresh connection. DaemonUnavailable if nobody answers."""
    from cachedaemon.errors import DaemonUnavailable

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        try:
            sock.connect(path)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise DaemonUnavailable(f"nothing answers on {path} ({exc.strerror})") from exc
        send(sock, msg, fds)
        try:
            return recv(sock, max_fds=max_fds)
        except EOFError as exc:
            raise ProtocolError(f"{path} closed the connection without a reply") from exc
    finally:
        sock.close()


async def call_async(path: str, msg: _Msg, *, timeout: float = 10.0) -> _Msg:
    """`call` for a request and a reply that carry no fds, on the running event loop
    instead of a worker thread (the supervisor's ping of a serving daemon, every heartbeat
    interval). DaemonUnavailable if nobody answers; ProtocolError on a bad or late reply."""
    from cachedaemon.errors import DaemonUnavailable

    try:
        async with asyncio.timeout(timeout):
            try:
                reader, writer = await asyncio.open_unix_connection(path)
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                raise DaemonUnavailable(f"nothing answers on {path} ({exc.strerror})") from exc
            try:
                writer.write(encode(msg))
                length = frame_length(await reader.readexactly(_HEADER.size))
                return decode(await reader.readexactly(length))
            except asyncio.IncompleteReadError as exc:
                raise ProtocolError(f"{path} closed the connection without a reply") from exc
            finally:
                writer.close()
    except TimeoutError as exc:
        raise ProtocolError(f"{path} did not answer within {timeout:.2f} s") from exc
