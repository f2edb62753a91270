"""`supervisor status` on the runtime dir of a supervisor killed with SIGKILL says at once that
none runs there (no holder of its lock), instead of waiting for an answer that cannot come."""

from __future__ import annotations

import signal
from pathlib import Path

from tests.engines.harness import Supervisor, topic, write_policy


def test_status_after_a_kill_9_says_none_runs(tmp_path: Path, tiny_model: Path) -> None:
    run = tmp_path / "run"
    sup = Supervisor(write_policy(tmp_path / "p.yaml", tiny_model, run))
    try:
        sup.wait(topic("supervisor.main.started"), timeout=120)
        assert sup.cli("status", "--json").returncode == 0
    finally:
        sup.stop(signal.SIGKILL)
    assert (run / "control").exists()  # a killed supervisor leaves its sockets
    cp = sup.cli("status", check=False)
    assert cp.returncode == 1
    assert cp.stderr.startswith(
        f"supervisor: no supervisor runs on {run}: none holds its lock (supervisor.lock)"
    ), cp.stderr
