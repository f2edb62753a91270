"""The event recorder on a real zmq PUB socket and the suite's own real mosquitto, through a
broker restart; process helpers on real child processes."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiomqtt
import zmq
import zmq.asyncio

from chaos.broker import OwnBroker
from chaos.procs import ProcRef, descendants, wait_gone
from chaos.recorder import EventRecorder, MqttTarget
from holdfast_contract.events import Event, encode_event


def _event(name: str, event: str) -> bytes:
    return encode_event(Event(ts=time.time(), kind="engine", name=name, event=event, epoch=1))


async def _publish_until(client: aiomqtt.Client, rec: EventRecorder, name: str) -> None:
    """Publish on MQTT until the recorder has it (QoS 1 may race the subscription)."""
    for _ in range(50):
        await client.publish("hf-test/events", _event(name, "mqtt"), qos=1)
        if await rec.wait_for(lambda ev: ev.name == name and ev.source == "mqtt", 0.2):
            return


def test_records_zmq_and_mqtt_and_survives_a_broker_restart() -> None:
    async def main() -> None:
        with tempfile.TemporaryDirectory(prefix="hfc-") as tmp:
            run = Path(tmp)
            async with OwnBroker(run) as broker:
                pub = zmq.asyncio.Context.instance().socket(zmq.PUB)
                pub.bind(f"ipc://{run}/events")
                rec = EventRecorder(run, MqttTarget(broker.host, broker.port, "hf-test/events"))
                stop = asyncio.Event()
                task = asyncio.create_task(rec.run(stop))
                for _ in range(50):  # PUB/SUB joins asynchronously: publish until seen
                    await pub.send_multipart([b"engine.e1.promoted", _event("e1", "promoted")])
                    if await rec.wait_for(lambda ev: ev.topic == "engine.e1.promoted", 0.1):
                        break
                async with aiomqtt.Client(broker.host, broker.port) as client:
                    await _publish_until(client, rec, "m1")
                await broker.stop()
                await broker.start()
                async with aiomqtt.Client(broker.host, broker.port) as client:
                    await _publish_until(client, rec, "m2")
                await pub.send_multipart([b"garbage"])
                stop.set()
                await asyncio.wait_for(task, 5.0)
                pub.close(linger=0)
            topics = {(ev.source, ev.topic) for ev in rec.rows}
            assert ("zmq", "engine.e1.promoted") in topics
            assert ("mqtt", "engine.m1.mqtt") in topics and ("mqtt", "engine.m2.mqtt") in topics

    asyncio.run(main())


def test_wait_gone_and_signals_only_the_same_process() -> None:
    async def main() -> None:
        parent = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import subprocess,sys,time;"
                "subprocess.Popen([sys.executable,'-c','import time; time.sleep(60)']);"
                "print('spawned', flush=True); time.sleep(60)",
            ],
            stdout=subprocess.PIPE,
        )
        try:
            assert parent.stdout is not None
            line = await asyncio.wait_for(asyncio.to_thread(parent.stdout.readline), 10.0)
            assert line == b"spawned\n"
            kids = descendants(parent.pid)
            assert len(kids) == 1 and kids[0].alive()
            ref = ProcRef.of(parent.pid)
            assert ref is not None
            assert await wait_gone([ref], 0.2) == [ref]  # still alive after the deadline
            assert kids[0].signal(signal.SIGKILL)
            assert await wait_gone(kids, 5.0) == []
            stale = ProcRef(kids[0].pid, kids[0].start + 1)
            assert not stale.signal(signal.SIGKILL)  # a different start time is never hit
        finally:
            parent.kill()
            parent.wait()
            if parent.stdout is not None:
                parent.stdout.close()

    asyncio.run(main())
