"""A start that fails on a busy port logs what happened, in the order it happened: the
supervisor starts, stops and is stopped; no daemon it never started is reported stopped,
and no broker connection is made after it says it stopped."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import yaml

from tests.engines.harness import env, mqtt_broker, write_policy

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
