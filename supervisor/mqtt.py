"""MQTT out of the supervisor: birth and Last Will, retained unit states, events at QoS 1.

Nothing here may delay supervision. `offer()` is synchronous and only appends to a bounded
queue (the oldest message is dropped, and counted, when full); one task owns the broker
connection, reconnects with backoff, and republishes retained states after each reconnect.

Stopping is cooperative: `close()` asks the task to publish what is queued (the offline
status last) and leave, and only cancels it if that takes too long. It never relies on one
`cancel()`: Python 3.11's `asyncio.wait_for`, which aiomqtt uses for CONNACK and PUBACK,
swallows a cancellation that arrives as the awaited reply does (CPython gh-86296), and a
task that lost its cancellation would keep the process alive for good.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from typing import NamedTuple

import aiomqtt
import structlog

from supervisor.aio import finish
from supervisor.backoff import backoff_wait, delay_for
from supervisor.policy import MqttSpec

log = structlog.get_logger("supervisor.mqtt")

# TCP connect, CONNACK and each PUBACK: bounds how long a stop can wait on the broker
BROKER_TIMEOUT_S = 1.0


class Outgoing(NamedTuple):
    topic: str
    payload: bytes
    qos: int
    retain: bool


class MqttPublisher:
    """Owns one broker connection; `start()` runs its task, `offer()` never blocks."""

    def __init__(self, spec: MqttSpec, queue_size: int, status_topic: str = "") -> None:
        self.spec = spec
        # a cluster node's own (<prefix>/node/<node>/status): nodes may share a prefix
        self.status_topic = status_topic or f"{spec.prefix}/status"
        self._queue: collections.deque[Outgoing] = collections.deque(maxlen=queue_size)
        self._retained: dict[str, Outgoing] = {}
        self._wake = asyncio.Event()
        self._closing = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
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

    @property
    def queued(self) -> int:
        """Messages offered and not yet published."""
        return len(self._queue)

    def retained(self) -> list[str]:
        """The retained topics offered so far."""
        return list(self._retained)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="mqtt")

    async def _run(self) -> None:
        attempt = 0
        while not self._closing.is_set():
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
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay_for(self._wait, attempt)):
                        await self._closing.wait()

    def _client(self) -> aiomqtt.Client:
        will = aiomqtt.Will(self.status_topic, b"offline", qos=1, retain=True)
        client = aiomqtt.Client(
            self.spec.host,
            self.spec.port,
            will=will,
            keepalive=self.spec.keepalive_s,
            timeout=BROKER_TIMEOUT_S,
        )
        # aiomqtt has no argument for paho's TCP connect timeout (5 s by default)
        client._client.connect_timeout = BROKER_TIMEOUT_S
        return client

    async def _session(self) -> None:
        async with self._client() as client:
            try:
                await client.publish(self.status_topic, b"online", qos=1, retain=True)
                self.connected = True
                log.info("mqtt_connected", host=self.spec.host, port=self.spec.port)
                await self._drain(client)
            finally:
                self.connected = False

    async def _drain(self, client: aiomqtt.Client) -> None:
        """Publish the retained states, then the queue as it fills, until closing."""
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
            if self._closing.is_set():
                return
            self._wake.clear()
            await self._wake.wait()

    async def _publish(self, client: aiomqtt.Client, msg: Outgoing) -> None:
        await client.publish(msg.topic, msg.payload, qos=msg.qos, retain=msg.retain)
        self.published += 1

    async def close(self, timeout: float) -> None:
        """Publish the offline status and what is queued, disconnect, end the task: all
        within about `timeout` (then the task is cancelled, as often as it takes)."""
        self.offer(self.status_topic, b"offline", qos=1, retain=True)
        self._closing.set()
        self._wake.set()
        if self._task is not None and not await finish(self._task, timeout):
            log.warning("mqtt_close_timeout", queued=len(self._queue), timeout_s=timeout)
