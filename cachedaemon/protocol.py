"""The messages of the daemon and the keeper, and the calls that carry them.

Framing and fd passing are `holdfast_contract.wire`'s (a length header, a msgpack body, fds
on the first byte); this module holds what the bodies are and this protocol's frame cap.
No pickle: every message is one of the structs below, decoded with `forbid_unknown_fields`.
This module imports neither torch nor anything that needs a GPU.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable
from typing import Any

import msgspec

from cachedaemon.config import CacheConfig
from cachedaemon.digest import FileDigest
from cachedaemon.errors import DaemonUnavailable
from cachedaemon.manifest import Manifest
from holdfast_contract import wire
from holdfast_contract.errors import ProtocolError

MAX_FRAME = 64 * 1024 * 1024  # a manifest of many thousand tensors fits
Fds = wire.Fds


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
    # the engine's files, digested (`verify: content`): when only the checkpoint's stat
    # facts differ, a pool whose digest equals this one is attached
    content: tuple[FileDigest, ...] = ()


class AttachReply(_Msg, frozen=True):
    manifest: Manifest  # one fd per chunk travels with this frame, in chunk order


class Mismatch(_Msg, frozen=True):
    fields: list[str]
    served: CacheConfig
    files: tuple[FileDigest, ...] = ()  # the pool's content digest, to name a file that differs


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
    files: tuple[FileDigest, ...] = ()  # the checkpoint's content digest, taken at load


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


class DepositKV(_Msg, frozen=True):
    """An engine's KV cache and its ledger (two memfds travel with this frame), kept under
    `key` until withdrawn or deposited again (engine/kvshare.py). `primary`: its engine
    serves as the primary (a standby holds its fds ahead of a promotion, ListKV)."""

    key: str
    primary: bool = False


class ReclaimKV(_Msg, frozen=True):
    key: str


class KVReclaimed(_Msg, frozen=True):
    key: str  # the KV cache's fd and its ledger's travel with this frame


class WithdrawKV(_Msg, frozen=True):
    key: str


class ListKV(_Msg, frozen=True):
    """The primaries' KV caches the keeper holds (`DepositKV.primary`)."""


class KVHeld(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    key: str
    ident: str  # which cache: `kv_ident` of its fd (a new deposit under `key` changes it)


class KVList(_Msg, frozen=True):
    caches: list[KVHeld]


def kv_ident(fd: int) -> str:
    """Which file `fd` is ("device:inode"): equal for every dup of it, in any process, and
    no other file's while one of them is open."""
    st = os.fstat(fd)
    return f"{st.st_dev}:{st.st_ino}"


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
    | DepositKV
    | ReclaimKV
    | KVReclaimed
    | WithdrawKV
    | ListKV
    | KVList
)

_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(Message)


def encode(msg: _Msg) -> bytes:
    """`msg` as one frame, header included."""
    return wire.frame_of(_encoder.encode(msg), MAX_FRAME)


def decode(body: bytes) -> _Msg:
    try:
        msg: _Msg = _decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"undecodable frame: {exc}") from exc
    return msg


def send(sock: socket.socket, msg: _Msg, fds: Fds = ()) -> None:
    """Send one message; fds (at most wire.MAX_FDS) ride on its first byte."""
    wire.send_frame(sock, encode(msg), fds)


def recv(
    sock: socket.socket, *, max_fds: int = 0, max_frame: int = MAX_FRAME
) -> tuple[_Msg, list[int]]:
    """Receive one message and the fds sent with it. Raises ProtocolError on a bad frame
    (fds that arrived are closed first) and EOFError on a clean close before any byte."""
    body, fds = wire.recv_frame(sock, max_frame=max_frame, max_fds=max_fds)
    try:
        return decode(body), fds
    except BaseException:
        wire.close_fds(fds)
        raise


def call(
    path: str,
    msg: _Msg,
    fds: Fds = (),
    *,
    max_fds: int = 0,
    timeout: float = 10.0,
) -> tuple[_Msg, list[int]]:
    """One request, one reply, over a fresh connection. DaemonUnavailable if nobody answers."""
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


async def call_async(
    path: str, msg: _Msg, *, timeout: float = 10.0, on_sent: Callable[[], object] | None = None
) -> _Msg:
    """`call` for a request and a reply that carry no fds, on the running event loop
    instead of a worker thread (the supervisor's ping of a serving daemon, every heartbeat
    interval). DaemonUnavailable if nobody answers; ProtocolError on a bad or late reply.
    `on_sent` is called once the request is written (the daemon has been asked)."""
    try:
        async with asyncio.timeout(timeout):
            try:
                reader, writer = await asyncio.open_unix_connection(path)
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                raise DaemonUnavailable(f"nothing answers on {path} ({exc.strerror})") from exc
            try:
                writer.write(encode(msg))
                if on_sent is not None:
                    on_sent()
                head = await reader.readexactly(wire.HEADER.size)
                return decode(await reader.readexactly(wire.frame_length(head, MAX_FRAME)))
            except asyncio.IncompleteReadError as exc:
                raise ProtocolError(f"{path} closed the connection without a reply") from exc
            finally:
                writer.close()
    except TimeoutError as exc:
        raise ProtocolError(f"{path} did not answer within {timeout:.2f} s") from exc
