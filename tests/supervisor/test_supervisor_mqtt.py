"""Events over MQTT with a broker of our own: birth, unit state, events, a broker outage that
does not slow failover, queued events delivered after it, and the Last Will on SIGKILL."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import aiomqtt
import msgspec
import pytest

from chaos.crew import kept_out
from holdfast_contract.control import CrewStatus
from holdfast_contract.wire import free_port
from tests.engines.harness import Load, Supervisor, get, topic, write_policy

MOSQUITTO = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
PREFIX = "hf-test/mqtt"


class Broker:
    """A mosquitto of our own on a free port (never the machine's shared one). It keeps
    its sessions in `store` across a restart, as a broker in service does: a subscriber's
    persistent session, and the QoS 1 messages queued for it, outlive the outage."""

    def __init__(self, port: int, store: Path) -> None:
        self.port = port
        self.proc: subprocess.Popen[bytes] | None = None
        store.mkdir(parents=True, exist_ok=True)
        self.conf = store / "mosquitto.conf"
        self.conf.write_text(
            f"listener {port} 127.0.0.1\nallow_anonymous true\n"
            f"persistence true\npersistence_location {store}/\n"
            "user root\n"  # (as root it would run as `mosquitto`, which cannot write `store`)
        )

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [MOSQUITTO, "-c", str(self.conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None


class Subscriber:
    """An aiomqtt client in a thread that records every message and reconnects."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.messages: list[tuple[str, bytes, bool]] = []
        self._cond = threading.Condition()
        self._loop = asyncio.new_event_loop()
        self._task: asyncio.Task[None] | None = None
        self._subscribed = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._subscribed.wait(15), "the test subscriber could not subscribe"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._task = self._loop.create_task(self._subscribe())
        with contextlib.suppress(asyncio.CancelledError):
            self._loop.run_until_complete(self._task)
        self._loop.close()

    async def _subscribe(self) -> None:
        while True:
            try:
                # a persistent session: QoS 1 events published while this subscriber
                # reconnects are kept for it by the broker
                async with aiomqtt.Client(
                    "127.0.0.1",
                    self.port,
                    identifier=f"hf-test-sub-{id(self)}",
                    clean_session=False,
                ) as client:
                    await client.subscribe(f"{PREFIX}/#", qos=1)
                    self._subscribed.set()
                    async for m in client.messages:
                        with self._cond:
                            self.messages.append(
                                (
                                    str(m.topic),
                                    bytes(m.payload),  # type: ignore[arg-type]
                                    bool(m.retain),
                                )
                            )
                            self._cond.notify_all()
            except aiomqtt.MqttError:
                await asyncio.sleep(0.1)  # broker down: try again

    def wait(
        self, topic_: str, payload: bytes | None = None, timeout: float = 15.0, after: int = 0
    ) -> bytes:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for t, p, _ in self.messages[after:]:
                    if t == topic_ and (payload is None or payload in p):
                        return p
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(
                        f"no {topic_} {payload!r} within {timeout}s; saw "
                        f"{[m[0] for m in self.messages[after:]][-20:]}"
                    )
                self._cond.wait(left)

    def mark(self) -> int:
        with self._cond:
            return len(self.messages)

    def close(self) -> None:
        if self._task is not None:
            self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(10)


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    b = Broker(free_port(), tmp_path / "broker")
    b.start()
    try:
        yield b
    finally:
        b.stop()


def test_mqtt_events_survive_a_broker_outage_and_last_will(
    broker: Broker, tmp_path: Path, tiny_model: Path
) -> None:
    sub = Subscriber(broker.port)
    # Memory for two serving engines only: the batch engine gets in while a serving slot
    # is down, and admission evicts it again when the slot comes back.
    policy = write_policy(
        tmp_path / "policy.yaml",
        tiny_model,
        tmp_path / "run",
        events={
            "mqtt": {"host": "127.0.0.1", "port": broker.port, "prefix": PREFIX, "keepalive_s": 2}
        },
        devices={"memory_mb": 250},
        engines={"memory_mb": 100, "batch": [{"name": "batch", "count": 1, "memory_mb": 100}]},
        heartbeat={"interval_ms": 100, "miss_limit": 5},
        # the batch engine must get in before the dead slot restarts
        restart={"initial_s": 1.0, "max_s": 2.0, "jitter_s": 0.01},
    )
    sup = Supervisor(policy)
    try:
        sub.wait(f"{PREFIX}/status", b"online")
        promoted = sup.wait(lambda e: e.event == "promoted", timeout=120)
        sub.wait(f"{PREFIX}/events", f'"name":"{promoted.name}","event":"promoted"'.encode())
        state = msgspec.json.decode(
            sub.wait(f"{PREFIX}/engine/{promoted.name}/state", b'"state":"primary"')
        )
        assert state["epoch"] == 1
        sup.wait(lambda e: e.event == "ready" and e.name != promoted.name, timeout=60)
        assert not any(e.name == "batch-1" for e in sup.tap.events), "batch-1 cannot fit"
        # ... and the supervisor says why, on the broker, in /cluster and `status --json`,
        # where the chaos suite reads it: it is not missing from the pool
        cap = "needs 100 MB beside 200 MB running; devices.memory_mb 250"
        retained = msgspec.json.decode(
            sub.wait(f"{PREFIX}/engine/batch-1/state", b'"memory-cap"', timeout=5)
        )
        assert retained["state"] == "dead" and retained["wanted"]["detail"] == cap, retained
        view = msgspec.convert(get(f"{sup.api}/cluster")[1], CrewStatus)
        batch = view.engine("batch-1")
        assert batch is not None and kept_out(batch) == f"memory-cap: {cap}"
        assert msgspec.convert(sup.status(), CrewStatus).engine("batch-1") == batch
        assert f"batch-1 wanted stopped: memory-cap: {cap}\n" in sup.cli("status").stdout

        broker.stop()  # mid-run outage: failover must not notice
        load = Load(sup.router, clients=2)
        try:
            load.wait_ok(10)
            mark = sup.tap.mark()
            t_kill = time.time()
            os.kill(get(f"{sup.api}/primary")[1]["pid"], signal.SIGKILL)
            second = sup.wait(lambda e: e.event == "promoted", timeout=5, after=mark)
            assert second.ts - t_kill < 1.0
            assert second.data["promote_ms"] < 50
            load.wait_ok(10)
            evicted = sup.wait(topic("engine.batch-1.evicted"), timeout=30, after=mark)
            assert evicted.data["reason"] == "admission"
            sup.wait(topic(f"engine.{promoted.name}.ready"), timeout=30, after=mark)
        finally:
            load.stop()
        assert load.failures == []

        mark = sub.mark()
        broker.start()  # back: the queued events arrive, status is online again
        sub.wait(f"{PREFIX}/status", b"online", timeout=20, after=mark)
        sub.wait(
            f"{PREFIX}/events",
            f'"name":"{second.name}","event":"promoted"'.encode(),
            timeout=20,
            after=mark,
        )

        mark = sub.mark()
        sup.stop(signal.SIGKILL)  # no clean offline: the broker sends the Last Will
        sub.wait(f"{PREFIX}/status", b"offline", timeout=15, after=mark)
    finally:
        if sup.proc.poll() is None:
            sup.stop(signal.SIGKILL)
        sub.close()
