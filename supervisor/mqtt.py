"""MQTT out of the supervisor: birth and Last Will, retained unit states, events at QoS 1.

Until `go_live()` (the supervisor has started) only events go out: no birth, no Last
Will, no retained state, so a supervisor that never started leaves the retained topics as
they were. Each connection first checks that no other live supervisor holds the prefix
(`mqttclaim`); while one does, nothing is published.

Nothing here may delay supervision. `offer()` is synchronous and only appends to a bounded
queue (the oldest message is dropped, and counted, when full); one task owns the broker
connection, reconnects with backoff, and republishes retained states after each reconnect.

Stopping is cooperative: `close()` asks the task to publish what is queued (the offline
status last) and leave, within `CLOSE_S`; a connection that breaks meanwhile is made again
at once, and a broker that cannot be reached again is given up. What is left unpublished
is logged (`mqtt_unpublished_at_stop`, naming the retained topics left as they were).
Only past the deadline is the task cancelled, and never by relying on one `cancel()`:
Python 3.11's `asyncio.wait_for`, which aiomqtt uses for CONNACK and PUBACK, swallows a
cancellation that arrives as the awaited reply does (CPython gh-86296), and a task that
lost its cancellation would keep the process alive for good.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from typing import NamedTuple

import aiomqtt
import msgspec
import structlog

from supervisor.aio import finish
from supervisor.backoff import backoff_wait, delay_for
from supervisor.mqttclaim import Owner, PrefixHeld, check, claim, owner_topic
from supervisor.policy import MqttSpec

log = structlog.get_logger("supervisor.mqtt")

# TCP connect, CONNACK and each PUBACK: a broker silent this long is away. A round trip
# on a busy machine (both cores taken) can take a good part of a second: a shorter bound
# would call a working connection broken and drop it.
BROKER_TIMEOUT_S = 5.0
# A clean stop's deadline for what is queued: the units' offline states and the offline
# status, each waiting for its PUBACK (at QoS 1), on a busy machine
CLOSE_S = 15.0


class Outgoing(NamedTuple):
    topic: str
    payload: bytes
    qos: int
    retain: bool
    seq: int  # the order of offers: which retained ones a republish covers


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
        self.offered = 0
        self.connected = False
        self._wait = backoff_wait(0.1, 2.0, 2.0, 0.1)
        self.owner = Owner.me()  # this supervisor, in the retained <...>/owner
        self.live = False  # started: birth, Last Will and retained states go out
        self.held_by = ""  # why the prefix is not ours, while another supervisor holds it
        self._up = False  # the current session got connected (its claim check passed)

    def offer(self, topic: str, payload: bytes, *, qos: int = 0, retain: bool = False) -> None:
        self.offered += 1
        msg = Outgoing(topic, payload, qos, retain, self.offered)
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

    async def claim(self) -> bool:
        """Before anything is published: raise PrefixHeld if another live supervisor holds
        the prefix; False if the broker could not be asked (each connect asks again)."""
        return await claim(self.spec, self.status_topic, self.owner, BROKER_TIMEOUT_S)

    def go_live(self) -> None:
        """The supervisor has started: from now on (after a reconnect with the Last Will)
        the owner, the birth and the retained states are published."""
        self.live = True
        self._wake.set()

    async def _run(self) -> None:
        """Connect, publish, connect again after a failure (with backoff), until closed.
        Once closing, a broken connection is made again at once; a connect that fails
        (the broker cannot be reached) or a prefix held by another ends it."""
        attempt = 0
        while True:
            self._up = False
            try:
                done = await self._session()
            except PrefixHeld as e:
                self.connected = False
                attempt += 1
                if self.held_by != str(e):
                    log.error("mqtt_prefix_held", error=str(e), published="nothing")
                self.held_by = str(e)
                if self._closing.is_set():
                    return
            except (aiomqtt.MqttError, OSError, TimeoutError) as e:
                self.connected = False
                attempt += 1
                self._unavailable(e, attempt)
                if self._closing.is_set() and not self._up:
                    return
            else:
                if done:
                    return
                attempt = 0
                continue  # (it left to connect again with the Last Will: at once)
            if not self._closing.is_set():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay_for(self._wait, attempt)):
                        await self._closing.wait()

    def _unavailable(self, e: BaseException, attempt: int) -> None:
        if attempt == 1 or attempt % 50 == 0 or self._closing.is_set():
            log.warning(
                "mqtt_unavailable",
                host=self.spec.host,
                port=self.spec.port,
                error=str(e) or type(e).__name__,
                attempt=attempt,
                queued=len(self._queue),
                closing=self._closing.is_set(),
            )

    def _client(self, live: bool) -> aiomqtt.Client:
        will = aiomqtt.Will(self.status_topic, b"offline", qos=1, retain=True) if live else None
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

    async def _session(self) -> bool:
        """One connection: True when it ended because the publisher is closing."""
        live = self.live
        async with self._client(live) as client:
            await check(client, self.status_topic, self.owner, BROKER_TIMEOUT_S)
            self.held_by = ""
            try:
                if live:
                    owner = msgspec.json.encode(self.owner)
                    await client.publish(owner_topic(self.status_topic), owner, qos=1, retain=True)
                    await client.publish(self.status_topic, b"online", qos=1, retain=True)
                self.connected = self._up = True
                log.info("mqtt_connected", host=self.spec.host, port=self.spec.port, live=live)
                guard = asyncio.create_task(self._keep_online(client)) if live else None
                try:
                    return await self._drain(client, live)
                finally:
                    if guard is not None:
                        guard.cancel()
                        await asyncio.gather(guard, return_exceptions=True)
            finally:
                self.connected = False

    async def _keep_online(self, client: aiomqtt.Client) -> None:
        """While live, an `offline` on our status topic is a predecessor's Last Will (it
        was killed on this host and its prefix taken over before the broker gave up on
        it): say `online` again."""
        await client.subscribe(self.status_topic, qos=1)
        async for m in client.messages:
            if m.payload == b"offline" and not self._closing.is_set():
                log.info("mqtt_status_restored", topic=self.status_topic)
                self.offer(self.status_topic, b"online", qos=1, retain=True)

    async def _drain(self, client: aiomqtt.Client, live: bool) -> bool:
        """Publish the retained states (once `live`), then the queue as it fills, until
        closing (True), or until the supervisor goes live (False: to connect again with
        the Last Will, closing or not).
        Before then retained messages are only kept (`_retained`), never sent. A queued
        retained message offered before the republish is covered by it (the republish
        sent that topic's latest); one offered since goes out in its turn."""
        covered = self.offered if live else 0
        if live:
            for msg in list(self._retained.values()):
                await self._publish(client, msg)
        while True:
            while self._queue:
                msg = self._queue[0]
                if not msg.retain or (live and msg.seq > covered):
                    await self._publish(client, msg)
                if self._queue and self._queue[0] is msg:
                    self._queue.popleft()
            if self.live != live:
                return False
            if self._closing.is_set():
                return True
            self._wake.clear()
            await self._wake.wait()

    async def _publish(self, client: aiomqtt.Client, msg: Outgoing) -> None:
        await client.publish(msg.topic, msg.payload, qos=msg.qos, retain=msg.retain)
        self.published += 1

    async def close(self, deadline: float = CLOSE_S) -> None:
        """Publish the offline status and what is queued, disconnect, end the task: within
        `deadline` seconds (then the task is cancelled, as often as it takes); what is left
        unpublished is logged. One that never went live publishes no offline status: it
        never said it was online. The owner is cleared (an empty retained message): the
        prefix is free."""
        if self.live:
            self.offer(owner_topic(self.status_topic), b"", qos=1, retain=True)
            self.offer(self.status_topic, b"offline", qos=1, retain=True)
        self._closing.set()
        self._wake.set()
        if self._task is None:
            return
        t0 = time.monotonic()
        ended = await finish(self._task, deadline)
        left = [m for m in self._queue if self.live or not m.retain]
        if left:
            log.warning(
                "mqtt_unpublished_at_stop",
                messages=len(left),
                retained=sorted({m.topic for m in left if m.retain}),
                why="deadline" if not ended else self.held_by or "broker unavailable",
                deadline_s=deadline,
                host=self.spec.host,
                port=self.spec.port,
            )
        else:
            log.info("mqtt_closed", published=self.published, s=round(time.monotonic() - t0, 3))
