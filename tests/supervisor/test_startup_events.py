"""The supervisor's log says what happened, in the order it happened: a start that fails on a
busy port starts, stops and is stopped (no daemon it never started is reported stopped, no
broker connection is made after it says it stopped); a stop names each part it waited on."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import yaml

from tests.engines.harness import Supervisor, env, mqtt_broker, topic, write_policy

EVENT = re.compile(r"\[\w+\s*\] (\S+)")


def test_a_busy_port_logs_only_what_happened_in_order(tmp_path: Path, tiny_model: Path) -> None:
    host, port = mqtt_broker()
    prefix = f"hf-test/{uuid.uuid4().hex}"
    policy = write_policy(
        tmp_path / "p.yaml",
        tiny_model,
        tmp_path / "run",
        events={"mqtt": {"host": host, "port": port, "prefix": prefix}},
    )
    listen = yaml.safe_load(policy.read_text())["api"]["listen"]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", int(listen.rpartition(":")[2])))
        busy.listen()
        cp = subprocess.run(
            [sys.executable, "-m", "supervisor", "run", str(policy)],
            env=env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert cp.returncode == 1, cp.stderr
    lines = cp.stderr.strip().splitlines()
    assert lines[-1].startswith(f"supervisor: cannot listen on {listen} (api.listen)"), cp.stderr
    logged = [m.group(1) for line in lines[:-1] if (m := EVENT.search(line))]
    assert logged == [
        "supervisor.main.starting",
        "supervisor.main.stopping",
        "supervisor.main.stopped",
    ], cp.stderr


def test_a_stop_names_each_part_it_waited_on(tmp_path: Path, tiny_model: Path) -> None:
    """Between the engines' `stopped` and the supervisor's, the log says which part the
    stop waited on and how long (the fork server and the daemons may each use their SIGTERM
    grace): no stretch of silence before the process exits."""
    sup = Supervisor(write_policy(tmp_path / "p.yaml", tiny_model, tmp_path / "run"))
    try:
        sup.wait(topic("supervisor.main.started"), timeout=120)
    finally:
        assert sup.stop(signal.SIGINT) == 0
    logged = [m.group(1) for line in sup.output().splitlines() if (m := EVENT.search(line))]
    tail = logged[logged.index("supervisor.main.stopping") :]
    assert tail[-1] == "supervisor.main.stopped", tail
    assert "part_stopped" in tail, tail
    parts = [line for line in sup.output().splitlines() if "part_stopped" in line]
    assert len(parts) == 1 and "part=daemons" in parts[0] and "ms=" in parts[0], parts
