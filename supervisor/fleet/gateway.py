"""etcd v3's JSON gateway (`/v3/...`) as the client (supervisor/fleet/etcd.py) reads and
writes it: each reply decoded into a frozen struct (int64 fields arrive as JSON strings,
bytes as base64: msgspec's lax mode converts both), keys and values written in base64, and
a watch's frames checked for an error, a cancel or a compaction."""

from __future__ import annotations

import base64
from typing import Any, Literal

import msgspec

from supervisor.fleet.errors import EtcdError


class KeyValue(msgspec.Struct, frozen=True):
    key: bytes = b""
    value: bytes = b""
    create_revision: int = 0
    mod_revision: int = 0
    version: int = 0
    lease: int = 0


class WatchEvent(msgspec.Struct, frozen=True):
    type: Literal["PUT", "DELETE"] = "PUT"
    kv: KeyValue = msgspec.field(default_factory=KeyValue)


class Header(msgspec.Struct, frozen=True):
    revision: int = 0


class Range(msgspec.Struct, frozen=True):
    header: Header = msgspec.field(default_factory=Header)
    kvs: list[KeyValue] = msgspec.field(default_factory=list)


class Lease(msgspec.Struct, frozen=True):
    ID: int = 0
    TTL: int = 0


class TimeToLive(msgspec.Struct, frozen=True):
    TTL: int = 0  # the gateway leaves a zero out
    grantedTTL: int = 0


class KeepAlive(msgspec.Struct, frozen=True):
    result: Lease = msgspec.field(default_factory=Lease)


class TxnPart(msgspec.Struct, frozen=True):
    response_range: Range | None = None


class Txn(msgspec.Struct, frozen=True):
    header: Header = msgspec.field(default_factory=Header)
    succeeded: bool = False
    responses: list[TxnPart] = msgspec.field(default_factory=list)


class WatchResult(msgspec.Struct, frozen=True):
    header: Header = msgspec.field(default_factory=Header)
    created: bool = False
    canceled: bool = False
    compact_revision: int = 0
    cancel_reason: str = ""
    events: list[WatchEvent] = msgspec.field(default_factory=list)


class WatchFrame(msgspec.Struct, frozen=True):
    result: WatchResult | None = None
    error: dict[str, Any] | None = None


class ErrorReply(msgspec.Struct, frozen=True):
    message: str = ""
    error: str = ""
    code: int = 0


def b64(data: str | bytes) -> str:
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode()


def prefix_end(prefix: str) -> str:
    """etcd's range_end for every key starting with `prefix` (its last byte plus one)."""
    raw = prefix.encode()
    return b64(raw[:-1] + bytes([raw[-1] + 1]))


def watch_result(frame: WatchFrame, prefix: str) -> WatchResult:
    if frame.error is not None or frame.result is None:
        raise EtcdError(f"etcd watch on {prefix}: {frame.error}")
    if frame.result.canceled or frame.result.compact_revision:
        raise EtcdError(
            f"etcd watch on {prefix} canceled: {frame.result.cancel_reason or 'compacted'} "
            f"(compact revision {frame.result.compact_revision})"
        )
    return frame.result
