"""What monitoring reads over MQTT, with a real client on the real broker: retained unit
states say `offline` after a clean stop, the Last Will says `offline` after kill -9 of the
supervisor, `died` and `fenced` carry the role the engine had, and `died.tail` is that
incarnation's own last lines, warnings first, within about 1 KB. The event bus on its own:
a state that changes while the retained states are republished after a connect goes out,
a stop waits out a broker slower than a second, and one that cannot reach the broker logs
what it leaves unpublished."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import uuid
from pathlib import Path

import aiomqtt
import msgspec
import paho.mqtt.client as paho
import structlog
from paho.mqtt.enums import CallbackAPIVersion

from supervisor.events import EventBus, UnitState
from supervisor.policy import EventsSpec, MqttSpec
from tests.engines.harness import ECHO, Supervisor, complete, get, mqtt_broker, write_policy
from tests.mqtt_broker import SessionBroker

TAIL_MAX = 1024


def retained(
    prefix: str, timeout: float = 15.0, broker: tuple[str, int] | None = None
) -> dict[str, bytes]:
    """Every retained message under `prefix`, as a new subscriber gets them: subscribe, then
    publish a marker of our own; it arrives after the retained messages the broker sent.
    On the session's broker unless `broker` names another."""
    host, port = broker or mqtt_broker()
    marker = f"{prefix}/test-marker/{uuid.uuid4().hex}"
    got: dict[str, bytes] = {}
    subscribed, done = threading.Event(), threading.Event()
    client = paho.Client(CallbackAPIVersion.VERSION2)

    def on_message(_c: paho.Client, _u: object, m: paho.MQTTMessage) -> None:
        if m.topic == marker:
            done.set()
        elif m.retain:
            got[m.topic] = m.payload

    client.on_message = on_message
    client.on_subscribe = lambda *_: subscribed.set()
    client.connect(host, port)
    client.loop_start()
    try:
        client.subscribe(f"{prefix}/#", qos=1)
        assert subscribed.wait(timeout), "no SUBACK from the broker"
        client.publish(marker, b"end", qos=1)
        assert done.wait(timeout), "our own marker never came back"
    finally:
        client.disconnect()
        client.loop_stop()
    return got


class Watcher:
    """A live subscriber to one topic; `wait(payload)` until that payload arrives."""

    def __init__(self, topic: str) -> None:
        host, port = mqtt_broker()
        self.seen: list[bytes] = []
        self._cond = threading.Condition()
        subscribed = threading.Event()
        self.client = paho.Client(CallbackAPIVersion.VERSION2)
        self.client.on_message = self._on_message
        self.client.on_subscribe = lambda *_: subscribed.set()
        self.client.connect(host, port)
        self.client.loop_start()
        self.client.subscribe(topic, qos=1)
        assert subscribed.wait(15), "no SUBACK from the broker"

    def _on_message(self, _c: paho.Client, _u: object, m: paho.MQTTMessage) -> None:
        with self._cond:
            self.seen.append(m.payload)
            self._cond.notify_all()

    def wait(self, payload: bytes, timeout: float = 15.0) -> None:
        with self._cond:
            ok = self._cond.wait_for(lambda: payload in self.seen, timeout)
        assert ok, f"never got {payload!r}; saw {self.seen}"

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def policy_for(tmp_path: Path, model: Path, prefix: str, **extra: object) -> Path:
    host, port = mqtt_broker()
    return write_policy(
        tmp_path / "p.yaml",
        model,
        tmp_path / "run",
        events={"mqtt": {"host": host, "port": port, "prefix": prefix, "keepalive_s": 2}},
        **extra,  # type: ignore[arg-type]
    )


def test_roles_tails_and_offline_states_after_a_clean_stop(
    tmp_path: Path, tiny_model: Path
) -> None:
    prefix = f"hf-test/{uuid.uuid4().hex}"
    sup = Supervisor(policy_for(tmp_path, tiny_model, prefix))
    try:
        p = sup.wait_pair(timeout=120).name  # whichever got ready first
        other = {"e1": "e2", "e2": "e1"}[p]
        primary_pid = get(f"{sup.api}/primary")[1]["pid"]
        complete(sup.router, "early", warn="disk almost full")
        for i in range(60):  # far more request lines than fit in a tail
            assert complete(sup.router, f"req-{i:02d}")[0] == 200
        mark = sup.tap.mark()
        os.kill(primary_pid, signal.SIGKILL)
        died = sup.wait(lambda e: e.topic == f"engine.{p}.died", timeout=10, after=mark)
        assert died.data["role"] == "primary", died.data
        tail = died.data["tail"]
        lines = tail.splitlines()
        assert len(tail.encode()) <= TAIL_MAX, tail
        assert lines[0] == f"WARNING echo pid={primary_pid}: disk almost full", tail
        assert lines[-1] == f"echo pid={primary_pid}: request 'req-59'", tail
        # it comes back as a standby, a new incarnation writing to the same log
        ready = sup.wait(lambda e: e.topic == f"engine.{p}.ready", timeout=60, after=mark)
        assert ready.data["role"] == "standby"
        second_pid = ready.data["pid"]
        sup.cli("promote", p)  # fences the primary, `other`
        fenced = sup.wait(lambda e: e.topic == f"engine.{other}.fenced", timeout=10, after=mark)
        assert fenced.data["role"] == "primary", fenced.data
        mark = sup.tap.mark()
        sup.cli("restart", p)
        died = sup.wait(lambda e: e.topic == f"engine.{p}.died", timeout=10, after=mark)
        assert died.data["role"] == "primary"
        assert died.data["tail"] == f"echo pid={second_pid}: started", died.data["tail"]
        assert f"[warning  ] engine.{p}.died" in sup.output()
        assert sup.stop(signal.SIGINT) == 0
    finally:
        if sup.proc.poll() is None:
            sup.stop(signal.SIGKILL)
    after = retained(prefix)
    assert after.pop(f"{prefix}/status") == b"offline"
    assert {t.split("/", 2)[2] for t in after} >= {
        "engine/e1/state",
        "engine/e2/state",
        "daemon/0/state",
    }
    for topic, payload in after.items():
        state = msgspec.json.decode(payload)
        assert state["state"] == "offline" and state["pid"] == 0, (topic, state)


def test_last_will_after_kill_9_and_quarantine_logged_as_error(
    tmp_path: Path, tiny_model: Path
) -> None:
    prefix = f"hf-test/{uuid.uuid4().hex}"
    watch = Watcher(f"{prefix}/status")
    policy = policy_for(
        tmp_path,
        tiny_model,
        prefix,
        engines={"command": [*ECHO, "--exit-now"], "standby": 0},
        restart={"max_restarts": 0},
    )
    sup = Supervisor(policy)
    try:
        watch.wait(b"online")
        q = sup.wait(lambda e: e.topic == "engine.e1.quarantined", timeout=120)
        assert q.data["role"] == "standby"  # it never got ready, so never primary
        assert "refusing to start (--exit-now)" in q.data["tail"]
        assert "[error    ] engine.e1.quarantined" in sup.output()
        sup.stop(signal.SIGKILL)  # no clean stop: the broker publishes the Last Will
        watch.wait(b"offline")
    finally:
        if sup.proc.poll() is None:
            sup.stop(signal.SIGKILL)
        watch.close()
    assert retained(prefix)[f"{prefix}/status"] == b"offline"


# ---- the event bus on its own, in this process ----
UNITS = 300  # retained states: republishing them takes as many round trips to the broker


def bus_for(tmp_path: Path, broker: tuple[str, int], prefix: str) -> EventBus:
    spec = EventsSpec(mqtt=MqttSpec(host=broker[0], port=broker[1], prefix=prefix))
    return EventBus(f"ipc://{tmp_path}/events", spec)


def unit(i: int, state: str) -> UnitState:
    return UnitState(ts=time.time(), kind="daemon", name=str(i), state=state, epoch=1, pid=1)


async def until_online(bus: EventBus, broker: tuple[str, int], prefix: str) -> None:
    """Start `bus`, live, and wait until its birth (`online`) is out."""
    async with aiomqtt.Client(*broker) as sub:
        await sub.subscribe(f"{prefix}/status", qos=1)
        bus.start()
        bus.go_live()
        async with asyncio.timeout(30):
            async for m in sub.messages:
                if m.payload == b"online":
                    return


def test_a_state_that_changes_while_retained_states_are_republished_goes_out(
    tmp_path: Path,
) -> None:
    """After each connect the retained states are republished; a unit whose state changes
    meanwhile (a node that wins its election as its publisher reconnects) must end with
    its new state, not the one the republish sent."""
    prefix = f"hf-test/{uuid.uuid4().hex}"
    bus = bus_for(tmp_path, mqtt_broker(), prefix)
    for i in range(UNITS):
        bus.state(unit(i, "serving"))
    last = f"{prefix}/daemon/{UNITS - 1}/state"

    async def watch() -> list[tuple[str, bytes]]:
        seen: list[tuple[str, bytes]] = []
        try:
            async with aiomqtt.Client(*mqtt_broker()) as sub:
                await sub.subscribe(f"{prefix}/#", qos=1)
                bus.start()
                bus.go_live()
                async with asyncio.timeout(60):
                    async for m in sub.messages:
                        seen.append((str(m.topic), bytes(m.payload)))  # type: ignore[arg-type]
                        if str(m.topic) == f"{prefix}/daemon/0/state":  # the republish began
                            bus.state(unit(UNITS - 1, "dead"))
                            bus.emit("test", "main", "mark", 1)  # queued after that state
                        elif str(m.topic) == f"{prefix}/events":
                            break
        finally:
            await bus.close()
        return seen

    seen = asyncio.run(watch())
    states = [msgspec.json.decode(p)["state"] for t, p in seen if t == last]
    assert states and states[-1] == "dead", states


FROZEN_S = 3.0  # the broker answers nothing for this long: longer than a second


def test_a_clean_stop_waits_out_a_broker_slower_than_a_second(tmp_path: Path) -> None:
    """A stop on a busy machine: every PUBACK of the offline states comes late. Each unit's
    last retained state still says offline, and so does the status."""
    (tmp_path / "broker").mkdir()
    own = SessionBroker(tmp_path / "broker")  # our own: frozen below
    broker = (own.host, own.port)
    prefix = f"hf-test/{uuid.uuid4().hex}"
    bus = bus_for(tmp_path, broker, prefix)
    for i in range(3):
        bus.state(unit(i, "serving"))

    async def stop_while_frozen() -> None:
        try:
            await until_online(bus, broker, prefix)
        except BaseException:
            await bus.close()
            raise
        os.kill(own.proc.pid, signal.SIGSTOP)
        try:
            stopping = asyncio.ensure_future(bus.close())
            await asyncio.sleep(FROZEN_S)  # a fault held for its length, not a wait
        finally:
            os.kill(own.proc.pid, signal.SIGCONT)
        await stopping

    try:
        asyncio.run(stop_while_frozen())
        after = retained(prefix, broker=broker)
    finally:
        os.kill(own.proc.pid, signal.SIGCONT)
        own.stop()
    assert after.pop(f"{prefix}/status") == b"offline"
    assert after.pop(f"{prefix}/owner", b"") == b""
    assert {t.removeprefix(prefix + "/") for t in after} == {f"daemon/{i}/state" for i in range(3)}
    for topic, payload in after.items():
        assert msgspec.json.decode(payload)["state"] == "offline", (topic, payload)


def test_a_stop_that_cannot_reach_the_broker_logs_what_it_leaves(tmp_path: Path) -> None:
    (tmp_path / "broker").mkdir()
    own = SessionBroker(tmp_path / "broker")  # our own: stopped below
    broker = (own.host, own.port)
    prefix = f"hf-test/{uuid.uuid4().hex}"
    bus = bus_for(tmp_path, broker, prefix)
    bus.state(unit(0, "serving"))

    async def stop_without_broker() -> list[dict[str, object]]:
        try:
            await until_online(bus, broker, prefix)
        except BaseException:
            await bus.close()
            raise
        own.stop()
        bus.state(unit(0, "dead"))
        with structlog.testing.capture_logs() as logs:
            await bus.close()
        return logs

    try:
        logs = asyncio.run(stop_without_broker())
    finally:
        own.stop()
    left = [e for e in logs if e["event"] == "mqtt_unpublished_at_stop"]
    assert len(left) == 1, logs
    assert left[0]["why"] == "broker unavailable", left
    assert f"{prefix}/daemon/0/state" in left[0]["retained"], left  # type: ignore[operator]
    assert f"{prefix}/status" in left[0]["retained"], left  # type: ignore[operator]
