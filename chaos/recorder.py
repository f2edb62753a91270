"""Records every supervisor event, from its zmq PUB stream and from MQTT, with wait helpers.

zmq reconnects by itself when a restarted supervisor binds `ipc://<run>/events` again;
the MQTT subscriber reconnects with a short backoff when the broker goes away.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiomqtt
import msgspec
import structlog
import zmq
import zmq.asyncio

from chaos.waiters import Rows
from holdfast_contract.events import EventName as N
from holdfast_contract.events import decode_event

log = structlog.get_logger("chaos.recorder")
MIGRATED_DETAIL = ("continued", "prefill", "kept", "stall_ms")


class EventRow(msgspec.Struct, frozen=True):
    ts: float  # the event's own timestamp (supervisor wall clock)
    received: float
    source: str  # zmq | mqtt
    kind: str
    name: str
    event: str
    epoch: int
    # a cut stream's continuation (router.<node>.migrated): how it began (continued:
    # adopted, kept, replayed), the prompt tokens it prefilled, its stall; else empty
    detail: dict[str, Any] = msgspec.field(default_factory=dict)

    @property
    def topic(self) -> str:
        return f"{self.kind}.{self.name}.{self.event}"


class MqttTarget(msgspec.Struct, frozen=True):
    host: str
    port: int
    topic: str  # `<prefix>/events`


class EventRecorder:
    def __init__(self, run_dir: Path, mqtt: MqttTarget | None) -> None:
        self.endpoint = f"ipc://{run_dir}/events"
        self.mqtt = mqtt
        self._rows: Rows[EventRow] = Rows()

    async def run(self, stop: asyncio.Event) -> None:
        async with asyncio.TaskGroup() as group:
            zmq_task = group.create_task(self._zmq())
            mqtt_task = group.create_task(self._mqtt(self.mqtt)) if self.mqtt is not None else None
            await stop.wait()
            zmq_task.cancel()
            if mqtt_task is not None:
                mqtt_task.cancel()

    @property
    def rows(self) -> list[EventRow]:
        return self._rows.items

    async def wait_for(self, match: Callable[[EventRow], bool], timeout: float) -> EventRow | None:
        """The first recorded event that matches, waiting up to `timeout` seconds for it."""
        return await self._rows.first(match, timeout)

    async def changed(self, timeout: float) -> None:
        """Return at the next recorded event, or after `timeout` seconds."""
        await self._rows.changed(timeout)

    def _add(self, data: bytes, source: str) -> None:
        try:
            ev = decode_event(data)
        except msgspec.DecodeError:
            return  # not an event: dropped
        detail = {}
        if ev.kind == "router" and ev.event == N.MIGRATED:
            detail = {k: ev.data[k] for k in MIGRATED_DETAIL if k in ev.data}
        self._rows.append(
            EventRow(ev.ts, time.time(), source, ev.kind, ev.name, ev.event, ev.epoch, detail)
        )

    async def _zmq(self) -> None:
        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(self.endpoint)
        try:
            while True:
                frames = await sock.recv_multipart()
                if len(frames) == 2:  # topic, event; anything else is dropped
                    self._add(frames[1], "zmq")
        finally:
            sock.close(linger=0)

    async def _mqtt(self, target: MqttTarget) -> None:
        while True:
            try:
                async with aiomqtt.Client(target.host, target.port, timeout=2.0) as client:
                    await client.subscribe(target.topic, qos=1)
                    async for message in client.messages:
                        payload = message.payload
                        if isinstance(payload, bytes | bytearray):
                            self._add(bytes(payload), "mqtt")
            except aiomqtt.MqttError as exc:
                log.debug("mqtt_reconnect", error=str(exc))
                await asyncio.sleep(0.2)
