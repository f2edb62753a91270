"""One real supervisor with echo engines, a real cache daemon and the real broker: boot,
kill -9 and SIGSTOP of the primary under router load, daemon death, batch eviction and
quarantine, operator commands, control hardening; and a clean stop of another one.

The tests share one supervisor but not an order: each first waits, on the events it
publishes, for the crew to be as it needs it (a ready standby, a daemon with a spare,
a running batch engine), and none waits a fixed time. The one exception is the metrics
test, which counts what all the others put the crew through, so the file runs on one
pytest-xdist worker (its own xdist group): split across two, each half has a supervisor
of its own.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiomqtt
import msgspec
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from holdfast_contract.events import Event
from tests.as_user import as_user
from tests.engines.harness import (
    ECHO,
    Load,
    Supervisor,
    complete,
    env,
    exits_within,
    get,
    mqtt_broker,
    pid_alive,
    topic,
    write_policy,
)
from tests.realtime_probe import realtime_allowed

pytestmark = pytest.mark.xdist_group("supervisor-failover")  # one supervisor: see above

HANG_S = 0.1 * 5
PREFIX = f"hf-test/{uuid.uuid4().hex[:8]}"


def start(base: Path, tiny_model: Path, prefix: str = PREFIX) -> Supervisor:
    host, port = mqtt_broker()
    policy = write_policy(
        base / "policy.yaml",
        tiny_model,
        base / "run",
        engines={
            "batch": [
                {"name": "batch", "count": 1, "priority": 0},
                {"name": "flaky", "count": 1, "priority": 1, "command": [*ECHO, "--exit-now"]},
                {
                    "name": "missing",
                    "count": 1,
                    "priority": 2,
                    "command": ["/nonexistent/engine-binary"],
                },
            ],
            "load": {"evict_above": 3, "respawn_below": 1, "respawn_hold_s": 0.5},
        },
        restart={"initial_s": 0.05, "max_s": 0.2, "max_restarts": 3, "window_s": 60},
        heartbeat={"interval_ms": 100, "miss_limit": 5},
        events={"mqtt": {"host": host, "port": port, "prefix": prefix}},
    )
    return Supervisor(policy)


@pytest.fixture(scope="module")
def sup(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Supervisor]:
    s = start(tmp_path_factory.mktemp("sup"), tiny_model)
    try:
        yield s
    finally:
        s.stop(signal.SIGKILL if s.proc.poll() is None else signal.SIGTERM)


def primary(sup: Supervisor) -> dict[str, Any]:
    code, body = get(f"{sup.api}/primary")
    assert code == 200, body
    return body  # type: ignore[no-any-return]


def api(sup: Supervisor, path: str) -> tuple[int, Any]:
    """GET on the health API; (0, {}) while it is not listening yet (the supervisor starts)."""
    try:
        return get(f"{sup.api}{path}")
    except OSError:
        return 0, {}


def wait_standby(sup: Supervisor, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    mark = 0
    while api(sup, "/standby")[0] != 200:
        sup.wait(topic_suffix(".ready"), max(0.1, deadline - time.monotonic()), after=mark)
        mark = sup.tap.mark()


def topic_suffix(suffix: str) -> Any:
    return lambda ev: ev.topic.endswith(suffix)


def wait_primary(sup: Supervisor, timeout: float = 120.0) -> dict[str, Any]:
    """Until /primary answers 200, woken by promotions; the primary's status."""
    deadline = time.monotonic() + timeout
    while True:
        mark = sup.tap.mark()
        code, body = api(sup, "/primary")  # not listening yet: the promotion comes later
        if code == 200:
            return body  # type: ignore[no-any-return]
        left = deadline - time.monotonic()
        assert left > 0, f"no primary within {timeout} s"
        sup.wait(lambda e: e.event == "promoted", left, after=mark)


def wait_state(sup: Supervisor, name: str, state: str, timeout: float = 30.0) -> None:
    """Until `supervisor status` shows engine `name` in `state`, woken by its events."""
    deadline = time.monotonic() + timeout
    while True:
        mark = sup.tap.mark()
        if {e["name"]: e["state"] for e in sup.status()["engines"]}[name] == state:
            return
        left = deadline - time.monotonic()
        assert left > 0, f"{name} did not become {state} within {timeout} s"
        sup.wait(lambda e: e.name == name, left, after=mark)


def wait_spare(sup: Supervisor, timeout: float = 90.0) -> dict[str, Any]:
    """Until daemon 0 serves and its hot spare stands by; its status."""
    sup.wait(topic("daemon.0.serving"), timeout=timeout)
    served = max(i for i, e in enumerate(list(sup.tap.events)) if e.topic == "daemon.0.serving")
    sup.wait(topic("daemon.0.spare_ready"), timeout=timeout, after=served)
    daemon: dict[str, Any] = sup.status()["daemons"][0]
    assert daemon["state"] == "serving"
    return daemon


def test_boot_promotes_one_primary_and_serves(sup: Supervisor) -> None:
    sup.wait(topic("daemon.0.serving"), timeout=120)
    first = sup.wait(lambda e: e.event == "promoted", timeout=60)
    assert first.epoch == 1 and first.data["cause"] == "no-primary"
    sup.wait(topic("engine.batch-1.ready"), timeout=60)
    wait_standby(sup)
    p = primary(sup)
    latest = [e for e in list(sup.tap.events) if e.event == "promoted"][-1]
    assert p["name"] == latest.name and p["state"] == "primary"
    code, body = complete(sup.router, "boot")
    assert code == 200 and body["engine"] == p["name"] and body["text"] == "echo:boot"
    st = sup.status()
    assert set(st) >= {"epoch", "primary", "engines", "daemons"}
    assert set(st["engines"][0]) >= {
        "name",
        "role",
        "state",
        "pid",
        "port",
        "restarts",
        "heartbeat_age_ms",
    }
    assert set(st["daemons"][0]) >= {
        "rank",
        "state",
        "pid",
        "fingerprint",
        "pool_bytes",
        "adoptions",
    }
    assert st["daemons"][0]["state"] == "serving" and st["daemons"][0]["pool_bytes"] > 0
    assert os.stat(sup.run).st_mode & 0o777 == 0o700


def test_birth_and_unit_state_on_the_broker(sup: Supervisor) -> None:
    sup.wait(topic("engine.e1.starting"), timeout=120)  # its state is retained from here
    host, port = mqtt_broker()
    wanted = {f"{PREFIX}/status": b"online", f"{PREFIX}/engine/e1/state": None}

    async def retained() -> dict[str, bytes]:
        seen: dict[str, bytes] = {}
        async with aiomqtt.Client(host, port) as client:
            await client.subscribe(f"{PREFIX}/#", qos=1)
            async with asyncio.timeout(10):
                async for msg in client.messages:
                    seen[str(msg.topic)] = bytes(msg.payload)  # type: ignore[arg-type]
                    if set(wanted) <= set(seen):
                        return seen
        return seen

    seen = asyncio.run(retained())
    assert seen[f"{PREFIX}/status"] == b"online"
    state = msgspec.json.decode(seen[f"{PREFIX}/engine/e1/state"])
    assert state["name"] == "e1" and state["kind"] == "engine"


def test_kill_primary_under_load_loses_no_request(sup: Supervisor) -> None:
    wait_standby(sup)
    old = primary(sup)
    load = Load(sup.router, clients=3)
    try:
        load.wait_ok(20)
        mark = sup.tap.mark()
        t_kill = time.time()
        os.kill(old["pid"], signal.SIGKILL)
        promoted = sup.wait(lambda e: e.event == "promoted", timeout=5, after=mark)
        assert promoted.name != old["name"]
        assert promoted.ts - t_kill < 1.0, "standby was not promoted within 1 s"
        assert promoted.data["previous"] == old["name"]
        # the promotion's own time split: CPU spent in it never exceeds its wall time
        assert 0 <= promoted.data["promote_cpu_ms"] <= promoted.data["promote_ms"] + 0.01
        died = sup.wait(topic(f"engine.{old['name']}.died"), timeout=5, after=mark)
        if "is exiting" in died.data["detail"]:  # seen by the exit watch: promoted as
            # SCHED_FIFO where this machine allows it (supervisor.realtime)
            assert promoted.data["promote_realtime"] is realtime_allowed()
        else:  # seen at the child's exit
            assert promoted.data["promote_realtime"] is False
        sup.wait(topic(f"engine.{old['name']}.ready"), timeout=30, after=mark)
        load.wait_ok(20)
    finally:
        load.stop()
    assert load.failures == []
    assert {old["name"], promoted.name} <= load.engines
    assert not pid_alive(old["pid"])


def test_sigstop_primary_is_fenced_and_replaced(sup: Supervisor) -> None:
    wait_standby(sup)
    old = primary(sup)
    load = Load(sup.router, clients=2)
    try:
        mark = sup.tap.mark()
        t_stop = time.time()
        os.kill(old["pid"], signal.SIGSTOP)
        died = sup.wait(topic(f"engine.{old['name']}.died"), timeout=5, after=mark)
        promoted = sup.wait(lambda e: e.event == "promoted", timeout=5, after=mark)
        assert died.data["cause"] == "hang"
        assert promoted.ts - t_stop < HANG_S + 1.0
        # promoted once the group is seen killed; its exit may come a moment later
        assert exits_within(old["pid"], 10), "the hung primary was not fenced"
        sup.wait(topic(f"engine.{old['name']}.ready"), timeout=30, after=mark)
    finally:
        load.stop()
    assert load.failures == []


def test_daemon_kill_engines_keep_serving_and_it_adopts_from_escrow(sup: Supervisor) -> None:
    from cachedaemon import protocol

    wait_standby(sup)
    daemon = wait_spare(sup)
    load = Load(sup.router, clients=2)
    try:
        mark = sup.tap.mark()
        os.kill(daemon["pid"], signal.SIGKILL)
        back = sup.wait(topic("daemon.0.serving"), timeout=90, after=mark)
    finally:
        load.stop()
    assert load.failures == [] and load.ok > 0
    assert back.data["adopted"] is True
    assert back.data["fingerprint"] == daemon["fingerprint"]
    reply, _ = protocol.call(str(sup.run / "daemon-0.sock"), protocol.StatusRequest())
    assert isinstance(reply, protocol.StatusReply) and reply.adopted
    assert sup.status()["daemons"][0]["adoptions"] == daemon["adoptions"] + 1
    # the hot spare took over (no new process had to start), and a new spare stands by:
    # a second kill is taken over by a spare again
    assert sup.wait(topic("daemon.0.starting"), timeout=5, after=mark).data.get("spare") is True
    second = sup.status()["daemons"][0]
    mark = sup.tap.mark()
    os.kill(second["pid"], signal.SIGKILL)
    assert sup.wait(topic("daemon.0.starting"), timeout=30, after=mark).data.get("spare") is True
    again = sup.wait(topic("daemon.0.serving"), timeout=90, after=mark)
    assert again.data["adopted"] is True and again.data["down_ms"] < 5000


def test_a_stopped_daemon_is_fenced_and_its_spare_takes_over(sup: Supervisor) -> None:
    daemon = wait_spare(sup)
    mark = sup.tap.mark()
    os.kill(daemon["pid"], signal.SIGSTOP)
    hung = sup.wait(topic("daemon.0.hung"), timeout=30, after=mark)
    assert hung.data["pid"] == daemon["pid"]
    back = sup.wait(topic("daemon.0.serving"), timeout=60, after=mark)
    assert back.data["adopted"] is True
    assert sup.status()["daemons"][0]["pid"] != daemon["pid"]


def test_load_evicts_batch_and_low_load_respawns_it(sup: Supervisor) -> None:
    wait_standby(sup)
    wait_state(sup, "batch-1", "batch")
    mark = sup.tap.mark()
    held = [
        threading.Thread(
            target=complete, args=(sup.router,), kwargs={"sleep_s": 2.0, "timeout": 30}
        )
        for _ in range(6)
    ]
    for t in held:
        t.start()
    evicted = sup.wait(topic("engine.batch-1.evicted"), timeout=10, after=mark)
    assert evicted.data["reason"].startswith("load")
    for t in held:
        t.join()
    back = sup.wait(topic("engine.batch-1.ready"), timeout=30, after=mark)
    assert back.ts - evicted.ts >= 0.5  # respawn_hold_s


def test_crash_loop_and_missing_command_are_quarantined(sup: Supervisor) -> None:
    flaky = sup.wait(topic("engine.flaky-1.quarantined"), timeout=60)
    assert "refusing to start (--exit-now)" in flaky.data["tail"]
    assert flaky.data["restarts"] == 4  # max_restarts 3, the 4th one quarantines
    missing = sup.wait(topic("engine.missing-1.quarantined"), timeout=10)
    assert "/nonexistent/engine-binary" in missing.data["detail"]
    states = {e["name"]: e["state"] for e in sup.status()["engines"]}
    assert states["flaky-1"] == states["missing-1"] == "quarantined"


def test_operator_promote_evict_restart(sup: Supervisor) -> None:
    wait_standby(sup)
    old = primary(sup)
    standby = next(e for e in sup.status()["engines"] if e["state"] == "standby")
    mark = sup.tap.mark()
    assert "is primary" in sup.cli("promote", standby["name"]).stdout
    promoted = sup.wait(lambda e: e.event == "promoted", timeout=5, after=mark)
    assert promoted.name == standby["name"] and promoted.data["cause"] == "operator"
    assert primary(sup)["name"] == standby["name"] and exits_within(old["pid"], 10)
    refused = sup.cli("promote", "batch-1", check=False)
    assert refused.returncode == 1 and "only a ready standby" in refused.stderr

    wait_state(sup, "batch-1", "batch")
    mark = sup.tap.mark()
    sup.cli("evict", "batch-1")
    evicted = sup.wait(topic("engine.batch-1.evicted"), timeout=10, after=mark)
    assert evicted.data["reason"] == "operator"
    # an operator eviction holds: with no load, an unheld one is back within
    # respawn_hold_s (0.5 s) and a tick; this one must not start in three times that
    with pytest.raises(AssertionError, match="no matching event"):
        sup.wait(topic("engine.batch-1.starting"), timeout=1.5, after=mark)
    assert {e["name"]: e["state"] for e in sup.status()["engines"]}["batch-1"] == "evicted"
    sup.cli("restart", "batch-1")
    restarting = sup.wait(topic("engine.batch-1.restarting"), timeout=10, after=mark)
    assert restarting.data["state"] == "dead"
    sup.wait(topic("engine.batch-1.ready"), timeout=30, after=mark)
    unknown = sup.cli("restart", "nope", check=False)
    assert unknown.returncode == 1 and "no engine named 'nope'" in unknown.stderr


def test_malformed_and_foreign_control_messages(sup: Supervisor) -> None:
    wait_primary(sup)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(f"ipc://{sup.run}/control")
    sock.send(b"\xc1 not msgpack")
    reply = msgspec.msgpack.decode(sock.recv())
    sock.close(linger=0)
    assert reply["ok"] is False and "malformed" in reply["message"]
    assert sup.status()["primary"] is not None  # still answering

    if os.getuid() != 0:
        pytest.skip("needs root to act as another uid")
    assert "is not yours" in as_uid(65534, sup.run)
    assert sup.proc.poll() is None and sup.status()["primary"] is not None


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(api: str) -> Samples:
    with urllib.request.urlopen(api + "/metrics", timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain; version=")
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def metric(samples: Samples, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels` (0 if none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def test_metrics_count_what_the_cluster_went_through(sup: Supervisor) -> None:
    """After the failovers, fences, evictions and refusals above, /metrics counts them."""
    wait_primary(sup)
    if sup.status()["epoch"] < 4:
        pytest.skip("counts what the tests above put the crew through: run the whole file")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"ipc://{sup.run}/agents")
    sock.send(b"\xc1 no agent sends this")  # counted as malformed by the agent hub
    deadline = time.monotonic() + 10
    try:
        while True:  # events reach the metrics task through a queue: wait until caught up
            m = scrape(sup.api)
            epoch = sup.status()["epoch"]
            total = metric(m, "holdfast_supervisor_promotions_total")
            agents = metric(m, "holdfast_supervisor_malformed_frames_total", socket="agents")
            if total == epoch and agents >= 1:
                break
            assert time.monotonic() < deadline, (epoch, total, agents)
            time.sleep(0.01)
    finally:
        sock.close(linger=0)
    sv = "holdfast_supervisor_"
    assert total >= 4  # boot, kill -9, SIGSTOP, operator: one epoch each
    for cause in ("exit", "hang", "operator"):
        assert metric(m, sv + "promotions_total", cause=cause) >= 1, cause
    assert metric(m, sv + "fences_total", kind="engine", cause="hang") >= 1
    assert metric(m, sv + "fences_total", kind="engine", cause="operator-promote") >= 1
    assert metric(m, sv + "fences_total", kind="daemon", cause="hang") >= 1
    assert metric(m, sv + "quarantines_total", kind="engine") >= 2
    assert metric(m, sv + "units", kind="engine", state="quarantined") == 2
    assert metric(m, sv + "evictions_total", reason="load") >= 1
    assert metric(m, sv + "evictions_total", reason="operator") >= 1
    assert metric(m, sv + "restarts_total", kind="engine") >= 3
    assert metric(m, sv + "restarts_total", kind="daemon") >= 2
    assert metric(m, sv + "malformed_frames_total", socket="control") >= 1
    assert metric(m, sv + "state_seconds_total", kind="engine", state="primary") > 0
    assert metric(m, sv + "state_duration_seconds_count", kind="engine", state="starting") >= 3
    assert metric(m, sv + "router_forwarded_total") > 0
    assert (sv + "router_retries_total", ()) in m and (sv + "router_failures_total", ()) in m
    assert metric(m, sv + "mqtt_connected") == 1
    assert (sv + "mqtt_queue_depth", ()) in m and (sv + "mqtt_dropped_total", ()) in m
    assert metric(m, sv + "events_total") >= metric(m, sv + "state_duration_seconds_count")


def as_uid(uid: int, run: Path) -> str:
    """What `supervisor stop` tells another uid: the message of its ControlError."""
    from holdfast_contract.control import StopReq
    from supervisor.control import request
    from supervisor.errors import ControlError

    def stop() -> str:
        try:
            request(f"ipc://{run}/control", StopReq(), timeout=2.0)
        except ControlError as e:
            return str(e)
        return "request went through"

    said: str = as_user(uid, stop)
    return said


def test_second_supervisor_on_the_same_dir_is_refused(sup: Supervisor) -> None:
    wait_primary(sup)
    cp = subprocess.run(
        [sys.executable, "-m", "supervisor", "run", str(sup.policy_path)],
        env=env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cp.returncode == 1
    assert f"another supervisor (pid {sup.proc.pid}) runs on {sup.run}" in cp.stderr
    assert sup.status()["primary"] is not None


def test_sigterm_stops_everything_cleanly(tmp_path: Path, tiny_model: Path) -> None:
    """On a supervisor of its own, so the others' can run before or after it."""
    sup = start(tmp_path, tiny_model, prefix=f"{PREFIX}-stop")
    try:
        sup.wait(topic("engine.batch-1.ready"), timeout=120)
        wait_standby(sup)
        stops_cleanly(sup)
    finally:
        sup.stop(signal.SIGKILL if sup.proc.poll() is None else signal.SIGTERM)


def stops_cleanly(sup: Supervisor) -> None:
    st = sup.status()
    pids = [e["pid"] for e in st["engines"] if e["pid"]] + [d["pid"] for d in st["daemons"]]
    assert len(pids) >= 4
    mark = sup.tap.mark()
    tap = sup.tap
    assert sup.stop(signal.SIGTERM) == 0, sup.output()
    assert any(
        isinstance(e, Event) and e.topic == "supervisor.main.stopped" for e in tap.events[mark:]
    )
    assert [p for p in pids if pid_alive(p)] == []
    left = sorted(p.name for p in sup.run.iterdir() if p.is_socket())
    assert left == [], f"stale sockets: {left}"
