"""MQTT out of the supervisor: birth and Last Will, retained unit states, events at QoS 1.

Nothing here may delay supervision. `offer()` is synchronous and only appends to a bounded
queue (the oldest message is dropped, and counted, when full); one task owns the broker
connection, reconnects with backoff, and republishes retained states after each reconnect.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from typing import NamedTuple

import aiomqtt
import structlog

from supervisor.backoff import backoff_wait, delay_for
from supervisor.policy import MqttSpec

log = structlog.get_logger("supervisor.mqtt")


class Outgoing(NamedTuple):
    topic: str
    payload: bytes
    qos: int
    retain: bool


class MqttPublisher:
    """Owns one broker connection; `run()` is its task, `offer()` never blocks."""

    def __init__(self, spec: MqttSpec, queue_size: int) -> None:
        self.spec = spec
        self.status_topic = f"{spec.prefix}/status"
        self._queue: collections.deque[Outgoing] = collections.deque(maxlen=queue_size)
        self._retained: dict[str, Outgoing] = {}
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self.dropped = 0
        self.published = 0
        self.connected = False
        self._wait = backoff_wait(0.1, 2.0, 2.0, 0.1)

    def offer(self, topic: str, payload: bytes, *, qos: int = 0, retain: bool = False) -> None:
        msg = Outgoing(topic, payload, qos, retain)
        if retain:
            self._retained[topic] = msg
        if len(self._queue) == self._queue.maxlen:
            self.dropped += 1
        self._queue.append(msg)
        self._wake.set()

    async def run(self) -> None:
        attempt = 0
        while True:
            try:
                await self._session()
            except (aiomqtt.MqttError, OSError) as e:
                self.connected = False
                attempt += 1
                if attempt == 1 or attempt % 50 == 0:
                    log.warning(
                        "mqtt_unavailable",
                        host=self.spec.host,
                        port=self.spec.port,
                        error=str(e),
                        attempt=attempt,
                        queued=len(self._queue),
                    )
                await asyncio.sleep(delay_for(self._wait, attempt))
            else:
                return

    async def _session(self) -> None:
        will = aiomqtt.Will(self.status_topic, b"offline", qos=1, retain=True)
        async with aiomqtt.Client(
            self.spec.host, self.spec.port, will=will, keepalive=self.spec.keepalive_s, timeout=2.0
        ) as client:
            await client.publish(self.status_topic, b"online", qos=1, retain=True, timeout=2.0)
            self.connected = True
            log.info("mqtt_connected", host=self.spec.host, port=self.spec.port)
            retained = set(self._retained)
            for msg in list(self._retained.values()):
                await self._publish(client, msg)
            while True:
                while self._queue:
                    msg = self._queue[0]
                    if not (msg.retain and msg.topic in retained):
                        await self._publish(client, msg)
                    if self._queue and self._queue[0] is msg:
                        self._queue.popleft()
                retained.clear()
                self._wake.clear()
                self._idle.set()
                await self._wake.wait()

    async def _publish(self, client: aiomqtt.Client, msg: Outgoing) -> None:
        await client.publish(msg.topic, msg.payload, qos=msg.qos, retain=msg.retain, timeout=2.0)
        self.published += 1

    async def flush(self, timeout: float) -> None:
        """Publish the retained offline status and wait (bounded) for the queue to empty."""
        self.offer(self.status_topic, b"offline", qos=1, retain=True)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                if self.connected:
                    self._idle.clear()
                    self._wake.set()
                    await self._idle.wait()
