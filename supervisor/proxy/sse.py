"""Server-sent events as the engines stream them and the router writes them: taking whole
events out of what came (`events`), an event's data (`data_of`) and its JSON (`json_of`),
and building one (`encode`, `error_event`, the `[DONE]` end, the `: migrated` comment)."""

from __future__ import annotations

import json
from typing import Any

DONE = b"data: [DONE]\n\n"
MIGRATED = b": migrated\n\n"  # an SSE comment where a continuation begins


def events(buf: bytearray) -> list[bytes]:
    """Take the complete server-sent events out of `buf` (each with its blank line)."""
    out = []
    while (end := buf.find(b"\n\n")) >= 0:
        out.append(bytes(buf[: end + 2]))
        del buf[: end + 2]
    return out


def data_of(event: bytes) -> bytes | None:
    """The data of one event (its `data:` lines joined), None if it has none."""
    lines = [ln[5:].lstrip() for ln in event.split(b"\n") if ln.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


def json_of(data: bytes | None) -> dict[str, Any] | None:
    """An event's data as a JSON object, None if it is not one."""
    try:
        obj = json.loads(data) if data is not None else None
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def encode(body: dict[str, Any]) -> bytes:
    """One event whose data is `body` as JSON."""
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def error_event(message: str, kind: str = "upstream_error", code: str | None = None) -> bytes:
    """The end of a stream that cannot be completed: OpenAI's error shape, no `[DONE]`."""
    return encode({"error": {"message": message, "type": kind, "param": None, "code": code}})
