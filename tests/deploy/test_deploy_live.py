"""A real supervisor started as systemd would start it (NOTIFY_SOCKET set): READY=1 comes
once its daemons serve, from its own pid; and every metric the Grafana dashboard and the
alert rules in deploy/ read is exported by its live /metrics or its engine's. What
KillMode=mixed relies on: SIGTERM to the supervisor alone stops the engines, then the
daemons, and leaves no process behind.

Also sdnotify itself over real unix datagram sockets (a path and an abstract name).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from supervisor import sdnotify
from tests.deploy.test_deploy import CONTAINERFILE, METRIC, alert_exprs, dashboard_exprs
from tests.engines.harness import Supervisor, mqtt_broker, pid_alive, write_policy

SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count")}


def datagram(path: str | bytes) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    s.settimeout(10)
    return s


def fields(data: bytes) -> dict[str, str]:
    return dict(line.split("=", 1) for line in data.decode().splitlines())


def test_notify_to_a_path_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with datagram(str(tmp_path / "notify")) as s:
        monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify"))
        assert sdnotify.ready("serving")
        got = fields(s.recv(4096))
    assert got == {"READY": "1", "STATUS": "serving", "MAINPID": str(os.getpid())}


def test_notify_to_an_abstract_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"holdfast-test-{uuid.uuid4().hex}"
    with datagram(b"\0" + name.encode()) as s:
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert sdnotify.notify("STATUS=x")
        assert s.recv(4096) == b"STATUS=x"


def test_notify_without_systemd_or_its_socket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert not sdnotify.ready("x")
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens"))
    assert not sdnotify.ready("x")  # logged, never raised: the supervisor goes on serving
    monkeypatch.setenv("NOTIFY_SOCKET", "relative/name")
    assert not sdnotify.ready("x")


class Booted:
    def __init__(self, sup: Supervisor, ready: dict[str, str]) -> None:
        self.sup, self.ready = sup, ready


@pytest.fixture(scope="module")
def booted(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Booted]:
    base = tmp_path_factory.mktemp("deploy")
    host, port = mqtt_broker()  # the mqtt_* metrics are there only with events.mqtt
    policy = write_policy(
        base / "policy.yaml",
        tiny_model,
        base / "run",
        engines={"command": ["{python}", "-m", "engine"], "ready_timeout_s": 120},
        heartbeat={"interval_ms": 100, "miss_limit": 10},
        events={"mqtt": {"host": host, "port": port, "prefix": f"hf-deploy/{uuid.uuid4().hex}"}},
    )
    notify = datagram(str(base / "notify"))
    notify.settimeout(240)
    saved = os.environ.get("NOTIFY_SOCKET")
    os.environ["NOTIFY_SOCKET"] = str(base / "notify")
    try:
        sup = Supervisor(policy)
    finally:
        if saved is None:
            os.environ.pop("NOTIFY_SOCKET", None)
        else:
            os.environ["NOTIFY_SOCKET"] = saved
    try:
        try:
            ready = fields(notify.recv(4096))
        except TimeoutError:
            raise AssertionError(f"no READY=1 from the supervisor:\n{sup.output()}") from None
        ready["daemon-0.ready"] = str((sup.run / "daemon-0.ready").exists())
        ready["health"] = str(urllib.request.urlopen(f"{sup.api}/health", timeout=5).status)
        sup.wait_pair()
        yield Booted(sup, ready)
    finally:
        notify.close()
        sup.stop(signal.SIGKILL if sup.proc.poll() is None else signal.SIGTERM)


def test_ready_comes_from_the_supervisor_once_its_daemons_serve(booted: Booted) -> None:
    r = booted.ready
    assert r["READY"] == "1" and r["MAINPID"] == str(booted.sup.proc.pid)
    assert r["daemon-0.ready"] == "True" and r["health"] == "200"


def exported(url: str) -> set[str]:
    """Every sample name `url`'s /metrics declares, whether it has samples yet or not."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(family.name + s for s in SUFFIXES.get(family.type, ()))
        names.update(s.name for s in family.samples)
    return names


@pytest.mark.parametrize("source", ["dashboard", "alerts"])
def test_every_metric_read_is_exported_live(booted: Booted, source: str) -> None:
    live = exported(booted.sup.api) | exported(booted.sup.router)  # router: the primary's
    assert "holdfast_supervisor_promotions_total" in live  # both scraped, not one empty
    assert "holdfast_engine_generated_tokens_total" in live
    exprs = dashboard_exprs() if source == "dashboard" else alert_exprs()
    for expr in exprs:
        used = set(METRIC.findall(expr))
        assert used, f"{source} query reads no holdfast metric: {expr}"
        assert used <= live, f"{source} reads {sorted(used - live)}, not exported: {expr}"


def healthcheck(api: str) -> int:
    """The Containerfile's HEALTHCHECK command, pointed at `api`: its exit status."""
    (argv,) = re.findall(r"HEALTHCHECK [^\n]*\\\n\s*CMD (\[.*\])", CONTAINERFILE.read_text())
    command = [a.replace("http://127.0.0.1:8001", api) for a in json.loads(argv)]
    assert command[0] == "python3" and any(api in a for a in command)
    return subprocess.run(command, capture_output=True, timeout=30, check=False).returncode


def test_sigterm_to_the_supervisor_alone_stops_engines_then_daemons(
    tmp_path: Path, tiny_model: Path
) -> None:
    """What `systemctl stop` does under KillMode=mixed (a supervisor of its own); the
    image's HEALTHCHECK passes while it runs and fails once it has stopped."""
    sup = Supervisor(write_policy(tmp_path / "policy.yaml", tiny_model, tmp_path / "run"))
    try:
        sup.wait_pair()
        st = sup.status()
        pids = [e["pid"] for e in st["engines"] if e["pid"]] + [d["pid"] for d in st["daemons"]]
        assert len(pids) >= 3, st
        assert healthcheck(sup.api) == 0
        mark = sup.tap.mark()
        assert sup.stop(signal.SIGTERM) == 0, sup.output()
        assert healthcheck(sup.api) != 0
        topics = [e.topic for e in sup.tap.events[mark:]]
        engines = [i for i, t in enumerate(topics) if t.startswith("engine.")]
        daemons = [i for i, t in enumerate(topics) if t == "daemon.0.stopped"]
        assert engines and daemons and max(engines) < daemons[0], topics
        assert topics[-1] == "supervisor.main.stopped", topics
        assert [p for p in pids if pid_alive(p)] == []
    finally:
        if sup.proc.poll() is None:
            sup.stop(signal.SIGKILL)
