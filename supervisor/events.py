"""The in-process event bus: every state change is one `Event`, fanned out to structlog, a
zmq PUB socket at `ipc://<run>/events` (topic frame, then `encode_event`) and MQTT.

`emit()` is synchronous and never blocks: PUB drops at its high-water mark, MQTT queues in
`MqttPublisher`, and in-process subscribers get a bounded asyncio queue each.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import msgspec
import structlog
import zmq

from holdfast_contract.control import Wanted
from holdfast_contract.events import Event, encode_event
from holdfast_contract.events import EventName as N
from supervisor.mqtt import MqttPublisher
from supervisor.policy import EventsSpec

log = structlog.get_logger("supervisor.events")


class UnitState(msgspec.Struct, frozen=True):
    """The retained payload of `<prefix>/<kind>/<name>/state`."""

    ts: float
    kind: str
    name: str
    state: str
    epoch: int
    role: str = ""
    pid: int = 0


class EngineUnitState(UnitState, frozen=True):
    """An engine's retained state: with what the supervisor's rules want of it."""

    wanted: Wanted | None = None


# events a person should notice; every other event is logged at info
LEVELS: dict[str, str] = {
    N.DIED: "warning",
    N.FENCED: "warning",
    N.DEAD: "warning",
    N.QUARANTINED: "error",
    N.MIGRATING: "warning",
}


class EventBus:
    def __init__(self, endpoint: str, spec: EventsSpec, node: str = "") -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 10000)
        self._pub.bind(endpoint)
        self.mqtt = None
        if spec.mqtt is not None:  # a cluster node's birth and Last Will are its own
            status = f"{spec.mqtt.prefix}/node/{node}/status" if node else ""
            self.mqtt = MqttPublisher(spec.mqtt, spec.queue, status)
        self._prefix = spec.mqtt.prefix if spec.mqtt is not None else ""
        self._qos = spec.mqtt.qos if spec.mqtt is not None else 0
        self._subscribers: list[asyncio.Queue[Event]] = []
        self._states: dict[str, UnitState] = {}
        self.count = 0

    async def claim(self) -> None:
        """Before the MQTT task starts: raise `mqttclaim.PrefixHeld` if another live
        supervisor publishes under this prefix (a broker that cannot be asked now is asked
        again at each connect, before anything is published)."""
        if self.mqtt is not None and not await self.mqtt.claim():
            log.warning(
                "mqtt prefix not checked: broker unavailable; checked again at each connect",
                host=self.mqtt.spec.host,
                port=self.mqtt.spec.port,
            )

    def start(self) -> None:
        if self.mqtt is not None:
            self.mqtt.start()

    def go_live(self) -> None:
        """The supervisor has started: MQTT's birth, Last Will and retained states go out
        (none before, so one that fails to start changes no retained topic)."""
        if self.mqtt is not None:
            self.mqtt.go_live()

    def emit(self, kind: str, name: str, event: str, epoch: int, **data: Any) -> Event:
        ev = Event(ts=time.time(), kind=kind, name=name, event=event, epoch=epoch, data=data)
        self.count += 1
        getattr(log, LEVELS.get(event, "info"))(ev.topic, epoch=epoch, **data)
        body = encode_event(ev)
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart([ev.topic.encode(), body], zmq.NOBLOCK)
        if self.mqtt is not None:
            self.mqtt.offer(f"{self._prefix}/events", body, qos=self._qos)
        for q in self._subscribers:
            with contextlib.suppress(asyncio.QueueFull):
                q.put_nowait(ev)
        return ev

    def state(self, st: UnitState) -> None:
        """Publish a unit's retained state (MQTT only; the event carries it elsewhere)."""
        if self.mqtt is not None:
            topic = f"{self._prefix}/{st.kind}/{st.name}/state"
            self._states[topic] = st
            self.mqtt.offer(topic, msgspec.json.encode(st), qos=self._qos, retain=True)

    def subscribe(self, size: int = 1000) -> asyncio.Queue[Event]:
        q: asyncio.Queue[Event] = asyncio.Queue(maxsize=size)
        self._subscribers.append(q)
        return q

    @property
    def dropped(self) -> int:
        return self.mqtt.dropped if self.mqtt is not None else 0

    async def close(self) -> None:
        """Mark every retained unit state offline (if they were published: once live),
        publish what is queued (within `mqtt.CLOSE_S`, logging what is not), disconnect."""
        if self.mqtt is not None:
            for topic, st in self._states.items() if self.mqtt.live else ():
                gone = msgspec.structs.replace(st, ts=time.time(), state="offline", pid=0)
                self.mqtt.offer(topic, msgspec.json.encode(gone), qos=self._qos, retain=True)
            await self.mqtt.close()
        self._pub.close(linger=500)  # let the last events (stopping, stopped) out
