"""One supervisor per MQTT prefix, on the test session's own mosquitto (a free port): a
second supervisor on a live one's prefix is refused before it publishes anything, one
that fails to start publishes nothing retained, and a prefix is free again after a clean
stop and after kill -9 of its supervisor on this host. Also the table of who holds a
prefix (`mqttclaim.holder`)."""

from __future__ import annotations

import os
import platform
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgspec
import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from supervisor.mqttclaim import Owner, holder, refusal
from tests.engines.harness import Supervisor, env, mqtt_broker, write_policy

ME = Owner("me", os.getpid(), platform.node(), 1.0)


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def owner(**changes: object) -> bytes:
    return msgspec.json.encode(msgspec.structs.replace(ME, instance="other", **changes))


@pytest.mark.parametrize(
    ("status", "owner_payload", "held"),
    [
        (None, None, None),  # never used
        (b"offline", owner(), None),  # stopped cleanly, or its Last Will
        (b"online", msgspec.json.encode(ME), None),  # ours (a reconnect)
        (b"online", owner(pid=os.getppid()), "other"),  # live, on this host
        (b"online", owner(host="elsewhere", pid=1), "other"),  # on another host: trusted
        (b"online", owner(pid=dead_pid()), None),  # killed here before its Last Will
        (b"online", None, "unknown"),  # a supervisor that names no instance
        (b"online", b"{not json", "unknown"),
    ],
    ids=[
        "unused",
        "offline",
        "ours",
        "live-here",
        "live-elsewhere",
        "dead-here",
        "no-owner",
        "bad",
    ],
)
def test_who_holds_a_prefix(
    status: bytes | None, owner_payload: bytes | None, held: str | None
) -> None:
    got = holder(status, owner_payload, ME)
    assert (got.instance if got is not None else None) == held


def test_the_refusal_names_the_prefix_and_what_to_change() -> None:
    held = Owner("abc", 42, "box", 1.0)
    msg = refusal("holdfast/demo", held)
    assert "'holdfast/demo'" in msg and "events.mqtt.prefix" in msg
    assert "instance abc, pid 42 on box" in msg


# ---- real supervisors on the session's broker ----
def retained(prefix: str, timeout: float = 15.0) -> dict[str, bytes]:
    """Every retained message under `prefix`: subscribe, then publish a marker of our own,
    which arrives after the retained messages the broker sent."""
    host, port = mqtt_broker()
    marker = f"{prefix}-marker/{uuid.uuid4().hex}"
    got: dict[str, bytes] = {}
    subscribed, done = threading.Event(), threading.Event()
    client = paho.Client(CallbackAPIVersion.VERSION2)

    def on_message(_c: paho.Client, _u: object, m: paho.MQTTMessage) -> None:
        if m.topic == marker:
            done.set()
        elif m.retain:
            got[m.topic] = bytes(m.payload)

    client.on_message = on_message
    client.on_subscribe = lambda *_: subscribed.set()
    client.connect(host, port)
    client.loop_start()
    try:
        client.subscribe([(f"{prefix}/#", 1), (marker, 1)])
        assert subscribed.wait(timeout), "no SUBACK from the broker"
        client.publish(marker, b"end", qos=1)
        assert done.wait(timeout), "our own marker never came back"
    finally:
        client.disconnect()
        client.loop_stop()
    return got


def policy(base: Path, tiny_model: Path, prefix: str, **sections: object) -> Path:
    host, port = mqtt_broker()
    base.mkdir(parents=True, exist_ok=True)
    return write_policy(
        base / "policy.yaml",
        tiny_model,
        base / "run",
        events={"mqtt": {"host": host, "port": port, "prefix": prefix, "keepalive_s": 5}},
        **sections,
    )


def run_to_exit(path: Path, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor", "run", str(path)],
        env=env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def until_retained(
    prefix: str, topics: set[str], timeout: float = 60.0, steady: bool = False
) -> dict[str, bytes]:
    """Until every one of `topics` (under `prefix`) is retained (and, `steady`, every
    engine's retained state is primary or standby); all that is."""
    deadline = time.monotonic() + timeout
    while True:
        got = retained(prefix)
        engines = [msgspec.json.decode(v)["state"] for t, v in got.items() if "/engine/" in t]
        settled = not steady or (len(engines) == 2 and set(engines) <= {"primary", "standby"})
        if topics <= {t.removeprefix(prefix + "/") for t in got} and settled:
            return got
        assert time.monotonic() < deadline, f"never retained {topics}: {sorted(got)}"
        time.sleep(0.1)  # a broker round trip per look


@pytest.fixture
def first(tmp_path: Path, tiny_model: Path) -> Iterator[tuple[Supervisor, str]]:
    prefix = f"hf-test/{uuid.uuid4().hex}"
    sup = Supervisor(policy(tmp_path / "first", tiny_model, prefix))
    try:
        sup.wait_pair(timeout=120)
        yield sup, prefix
    finally:
        sup.stop(signal.SIGKILL if sup.proc.poll() is None else signal.SIGTERM)


def test_a_second_supervisor_on_a_live_prefix_is_refused_and_changes_nothing(
    first: tuple[Supervisor, str], tmp_path: Path, tiny_model: Path
) -> None:
    sup, prefix = first
    before = until_retained(prefix, {"status", "owner", "daemon/0/state"}, steady=True)
    assert before[f"{prefix}/status"] == b"online"
    # the same ports and prefix, another runtime dir: as a second `supervisor run` would be
    second = policy(
        tmp_path / "second",
        tiny_model,
        prefix,
        router={"listen": sup.policy["router"]["listen"]},
        api={"listen": sup.policy["api"]["listen"]},
    )
    cp = run_to_exit(second)
    out = cp.stdout + cp.stderr
    assert cp.returncode != 0, out
    assert f"MQTT prefix '{prefix}'" in out and "events.mqtt.prefix" in out, out
    live = msgspec.json.decode(before[f"{prefix}/owner"], type=Owner)
    assert f"instance {live.instance}, pid {sup.proc.pid}" in out, out
    started = list((tmp_path / "second" / "run" / "logs").iterdir())
    assert started == [], "it started something"  # no daemon, no engine: no logs
    assert retained(prefix) == before  # not one retained topic touched
    assert sup.proc.poll() is None


def test_a_supervisor_that_fails_to_start_publishes_nothing_retained(
    tmp_path: Path, tiny_model: Path
) -> None:
    prefix = f"hf-test/{uuid.uuid4().hex}"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = f"127.0.0.1:{busy.getsockname()[1]}"
        cp = run_to_exit(policy(tmp_path, tiny_model, prefix, router={"listen": taken}))
    out = cp.stdout + cp.stderr
    assert cp.returncode != 0 and f"cannot listen on {taken}" in out, out
    assert retained(prefix) == {}


def test_a_prefix_is_free_after_kill_9_on_this_host_and_after_a_clean_stop(
    first: tuple[Supervisor, str], tmp_path: Path, tiny_model: Path
) -> None:
    sup, prefix = first
    until_retained(prefix, {"status", "owner"})
    sup.stop(signal.SIGKILL)  # its Last Will is seconds away: the prefix is taken over now
    again = Supervisor(policy(tmp_path / "again", tiny_model, prefix))
    try:
        again.wait_pair(timeout=120)
        got = until_retained(prefix, {"status", "owner"})
        assert got[f"{prefix}/status"] == b"online"
        assert msgspec.json.decode(got[f"{prefix}/owner"], type=Owner).pid == again.proc.pid
        assert again.stop(signal.SIGTERM) == 0
    finally:
        if again.proc.poll() is None:
            again.stop(signal.SIGKILL)
    assert retained(prefix)[f"{prefix}/status"] == b"offline"
    third = Supervisor(policy(tmp_path / "third", tiny_model, prefix))
    try:
        third.wait_pair(timeout=120)
        assert third.stop(signal.SIGTERM) == 0
    finally:
        if third.proc.poll() is None:
            third.stop(signal.SIGKILL)
