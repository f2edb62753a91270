"""One supervisor per MQTT prefix: the birth message names its instance, and a newcomer
that finds another live one stops before it touches any retained state.

Next to the retained `<prefix>/status` (`online` / `offline`, and the Last Will) a live
supervisor keeps the retained `<prefix>/owner`: `Owner`, its instance id, pid, host and
start time (a cluster node: `<prefix>/node/<node>/status` and `.../owner`). Before it
publishes anything, a supervisor reads both, on a connection of its own without a Last
Will, and a marker it sends itself tells it when the broker has handed over every
retained message. The prefix is held by another when the status says `online` and the
owner is not this instance, unless that owner is a process of this host that no longer
runs (killed before its Last Will was due: it is taken over at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import time
import uuid

import aiomqtt
import msgspec

from supervisor.errors import StartupError
from supervisor.policy import MqttSpec


class Owner(msgspec.Struct, frozen=True):
    """The retained `<...>/owner`: which supervisor holds the prefix."""

    instance: str
    pid: int
    host: str
    started: float  # time.time() at start

    @classmethod
    def me(cls) -> Owner:
        return cls(uuid.uuid4().hex, os.getpid(), platform.node(), time.time())


class PrefixHeld(StartupError):
    """Another live supervisor publishes under this MQTT prefix."""


def owner_topic(status_topic: str) -> str:
    return f"{status_topic.rsplit('/', 1)[0]}/owner"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def holder(status: bytes | None, owner: bytes | None, me: Owner) -> Owner | None:
    """The other live supervisor that holds the prefix, from its retained status and owner
    payloads (None: not retained); None when the prefix is free or already ours."""
    if status != b"online":
        return None  # offline after a clean stop or by the Last Will, or never used
    try:
        held = msgspec.json.decode(owner, type=Owner) if owner else None
    except msgspec.DecodeError:
        held = None
    if held is None:  # online with no (readable) owner: a supervisor that names none
        return Owner("unknown", 0, "", 0.0)
    if held.instance == me.instance:
        return None
    if held.host == me.host and not pid_alive(held.pid):
        return None  # killed on this host before its Last Will was due
    return held


def refusal(prefix: str, held: Owner) -> str:
    who = (
        f"instance {held.instance}, pid {held.pid} on {held.host or 'an unknown host'}"
        if held.pid
        else "a supervisor that does not name its instance"
    )
    return (
        f"another supervisor ({who}) is live on MQTT prefix {prefix!r}; set "
        "events.mqtt.prefix to another prefix, or stop that supervisor first"
    )


async def read_retained(
    client: aiomqtt.Client, topics: list[str], timeout: float
) -> dict[str, bytes]:
    """The retained messages of `topics`, as the broker hands them to a new subscription:
    subscribe, then publish a marker of our own (not retained); it comes after them."""
    marker = f"{topics[0].rsplit('/', 1)[0]}/claim/{uuid.uuid4().hex}"
    got: dict[str, bytes] = {}
    async with asyncio.timeout(timeout):
        for t in [*topics, marker]:
            await client.subscribe(t, qos=1)
        await client.publish(marker, b"", qos=1)
        async for m in client.messages:
            topic = str(m.topic)
            if topic == marker:
                break
            if m.retain and isinstance(m.payload, bytes):
                got[topic] = m.payload
        for t in [*topics, marker]:
            with contextlib.suppress(aiomqtt.MqttError):
                await client.unsubscribe(t)
    return got


async def check(client: aiomqtt.Client, status_topic: str, me: Owner, timeout: float) -> None:
    """Raise PrefixHeld if another live supervisor holds `status_topic`'s prefix."""
    owner = owner_topic(status_topic)
    got = await read_retained(client, [status_topic, owner], timeout)
    held = holder(got.get(status_topic), got.get(owner), me)
    if held is not None:
        raise PrefixHeld(refusal(status_topic.rsplit("/", 1)[0], held))


async def claim(spec: MqttSpec, status_topic: str, me: Owner, timeout: float) -> bool:
    """Before start-up touches MQTT: raise PrefixHeld if another live supervisor holds the
    prefix. False when the broker cannot be asked now (the publisher asks again at each
    connect, before it publishes anything)."""
    client = aiomqtt.Client(spec.host, spec.port, timeout=timeout)  # no Last Will
    client._client.connect_timeout = timeout
    try:
        async with client:
            await check(client, status_topic, me, timeout)
    except (aiomqtt.MqttError, OSError, TimeoutError):
        return False
    return True
