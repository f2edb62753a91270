"""One answer as a client reads it: its status, the router's labels (the engine, the epoch,
the model version that made it), its token ids, and, of a stream, whether it ended whole.

A stream is read line by line: it must end with `data: [DONE]` (an error event or a cut
is a broken stream) and, with `ignore_eos`, carry exactly `max_tokens` token ids. The
router marks a stream it continued on the next primary with a `: migrated` comment; the
client counts them and measures its stall: last token before the mark to the first after
it. A collected (non-streamed) answer also names its version in `system_fingerprint`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import aiohttp
import msgspec

VERSION_HEADER = "X-Holdfast-Model-Version"  # the model version that made the answer


class Reply(msgspec.Struct, frozen=True):
    status: int
    engine: str = ""
    epoch: int | None = None
    error: str = ""
    tokens: int = 0
    retry_after: float | None = None  # seconds, from a 503's Retry-After
    broken: bool = False
    migrated: int = 0
    stall_ms: float | None = None
    digest: str = ""  # of the token ids of a whole answer
    version: str = ""  # X-Holdfast-Model-Version
    fingerprint: str = ""  # a collected answer's system_fingerprint


class _Usage(msgspec.Struct):
    completion_tokens: int = 0


class _Choice(msgspec.Struct):
    token_ids: list[int] | None = None


class _Answer(msgspec.Struct):
    usage: _Usage = msgspec.field(default_factory=_Usage)
    choices: list[_Choice] = []
    system_fingerprint: str | None = None


def digest(ids: Sequence[int]) -> str:
    return hashlib.sha1(str(list(ids)).encode()).hexdigest()[:16]


def labelled(resp: aiohttp.ClientResponse, **fields: Any) -> Reply:
    """A reply to `resp` with the router's labels (engine, epoch, version) and `fields`."""
    epoch = resp.headers.get("X-Holdfast-Epoch", "")
    labels = Reply(
        resp.status,
        resp.headers.get("X-Holdfast-Engine", ""),
        int(epoch) if epoch.isdigit() else None,
        version=resp.headers.get(VERSION_HEADER, ""),
    )
    return msgspec.structs.replace(labels, **fields)


def collected(resp: aiohttp.ClientResponse, raw: bytes) -> Reply:
    """A non-streamed answer: its labels, output tokens, token ids and fingerprint."""
    retry = retry_after(resp.status, resp.headers.get("Retry-After"))
    if resp.status != 200:
        return labelled(resp, retry_after=retry)
    try:
        answer = msgspec.json.decode(raw, type=_Answer)
    except msgspec.DecodeError:
        return labelled(resp)
    ids = [i for c in answer.choices for i in (c.token_ids or ())]
    return labelled(
        resp,
        tokens=answer.usage.completion_tokens,
        digest=digest(ids) if ids else "",
        fingerprint=answer.system_fingerprint or "",
    )


def retry_after(status: int, header: str | None) -> float | None:
    """Seconds a 503 asks the client to wait (RFC 9110 delay-seconds); None otherwise."""
    if status != 503 or header is None:
        return None
    try:
        return max(0.0, float(header.strip()))
    except ValueError:
        return 0.0  # an HTTP date: retry after the usual backoff, still shed


class StreamCheck:
    """A streamed answer read line by line as a client sees it."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.done = False
        self.error = ""
        self.migrated = 0
        self.stalls: list[float] = []
        self._last = 0.0  # monotonic time of the last token
        self._mark: float | None = None  # _last when a `: migrated` comment came

    def line(self, raw: bytes, now: float) -> None:
        text = raw.strip()
        if text.startswith(b":"):
            self.migrated += 1
            self._mark = self._last
        elif text.startswith(b"data:"):
            data = text[5:].strip()
            if data == b"[DONE]":
                self.done = True
                return
            obj = json.loads(data)
            if "error" in obj:
                self.error = str(obj["error"].get("message", obj["error"]))[:200]
                return
            before = len(self.ids)
            for choice in obj.get("choices") or ():
                self.ids.extend(choice.get("token_ids") or ())
            if len(self.ids) > before:
                if self._mark is not None:
                    self.stalls.append((now - self._mark) * 1000.0)
                    self._mark = None
                self._last = now

    def reply(self, resp: aiohttp.ClientResponse, expect: int | None) -> Reply:
        short = expect is not None and len(self.ids) != expect
        broken = not self.done or bool(self.error) or short
        error = self.error or (
            "the stream ended without data: [DONE]"
            if not self.done
            else f"{len(self.ids)} tokens, not {expect}"
            if short
            else ""
        )
        return labelled(
            resp,
            error=error,
            tokens=len(self.ids),
            broken=broken,
            migrated=self.migrated,
            stall_ms=round(max(self.stalls), 3) if self.stalls else None,
            digest="" if broken else digest(self.ids),
        )

    def cut(self, resp: aiohttp.ClientResponse, error: str) -> Reply:
        """The stream was cut after it began: a broken stream, never retried."""
        return labelled(resp, status=200, error=error, tokens=len(self.ids), broken=True)
