"""Supervisor events as they travel: JSON on the zmq PUB socket `ipc://<run>/events` and
on MQTT; the chaos suite and tests read them back with `decode_event`."""

from __future__ import annotations

from typing import Any

import msgspec


class Event(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One state change. Topic-style name: `<kind>.<name>.<event>` (engine.e1.promoted)."""

    ts: float
    kind: str  # engine | daemon | supervisor | broker | router
    name: str
    event: str
    epoch: int
    data: dict[str, Any] = {}

    @property
    def topic(self) -> str:
        return f"{self.kind}.{self.name}.{self.event}"


_event_decoder: msgspec.json.Decoder[Event] = msgspec.json.Decoder(Event)


def encode_event(ev: Event) -> bytes:
    return msgspec.json.encode(ev)


def decode_event(data: bytes) -> Event:
    return _event_decoder.decode(data)
