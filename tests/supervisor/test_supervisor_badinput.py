"""Bad input is refused before anything starts, with a message naming what to change, and
nothing already in the runtime dir is touched."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.engines.harness import ECHO, Supervisor, env, get, pid_alive, write_policy


def run(policy: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor", "run", str(policy)],
        env=env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_missing_model_path_is_a_policy_error(tmp_path: Path) -> None:
    policy = write_policy(tmp_path / "p.yaml", tmp_path / "no-such-model", tmp_path / "run")
    cp = run(policy)
    assert cp.returncode == 2
    assert f"$.model.path: {tmp_path / 'no-such-model'} does not exist" in cp.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to make a dir another uid owns")
def test_runtime_dir_of_another_user_is_refused(tmp_path: Path, tiny_model: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "keep.txt").write_text("theirs")
    os.chown(run_dir, 65534, 65534)
    cp = run(write_policy(tmp_path / "p.yaml", tiny_model, run_dir))
    assert cp.returncode == 1
    assert f"runtime dir {run_dir} is owned by uid 65534" in cp.stderr
    assert "set cache.runtime_dir" in cp.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == ["keep.txt"]


def test_router_port_in_use_fails_before_loading(tmp_path: Path, tiny_model: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        policy = write_policy(
            tmp_path / "p.yaml",
            tiny_model,
            tmp_path / "run",
            router={"listen": f"127.0.0.1:{port}"},
        )
        cp = run(policy)
    assert cp.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in cp.stderr and "router.listen" in cp.stderr
    assert not (tmp_path / "run" / "daemon-0.ready").exists()
    assert [p.name for p in (tmp_path / "run").iterdir() if p.is_socket()] == []


def test_status_without_a_supervisor_says_so(tmp_path: Path) -> None:
    cp = subprocess.run(
        [sys.executable, "-m", "supervisor", "status", "--runtime-dir", str(tmp_path)],
        env=env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert cp.returncode == 1
    assert f"no supervisor runs on {tmp_path}" in cp.stderr


def test_sigterm_while_daemons_load_stops_at_once(tmp_path: Path, tiny_model: Path) -> None:
    sup = Supervisor(write_policy(tmp_path / "p.yaml", tiny_model, tmp_path / "run"))
    try:
        daemon_pid = loading_daemon(sup)
        t0 = time.monotonic()
        code = sup.stop(signal.SIGTERM, timeout=20)
    finally:
        if sup.proc.poll() is None:
            sup.stop(signal.SIGKILL)
    assert code == 0, sup.output()
    assert time.monotonic() - t0 < 10
    assert not pid_alive(daemon_pid)
    assert [p.name for p in (tmp_path / "run").iterdir() if p.is_socket()] == []


def loading_daemon(sup: Supervisor, timeout: float = 60.0) -> int:
    """The pid of the daemon while it still loads, read from the health API (which binds
    before daemons start; events that early can beat the test's subscription)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            daemons = get(f"{sup.api}/cluster", timeout=1.0)[1]["daemons"]
        except OSError:
            daemons = []
        if daemons and daemons[0]["state"] == "starting" and daemons[0]["pid"]:
            return int(daemons[0]["pid"])
        time.sleep(0.02)  # the API is up within a second; this only paces the retries
    raise AssertionError(f"no loading daemon within {timeout}s:\n{sup.output()}")


def test_engines_that_refuse_promotion_are_fenced_not_routed(
    tmp_path: Path, tiny_model: Path
) -> None:
    policy = write_policy(
        tmp_path / "p.yaml",
        tiny_model,
        tmp_path / "run",
        engines={"command": [*ECHO, "--refuse-promote"]},
        restart={"max_restarts": 0},
    )
    sup = Supervisor(policy)
    try:
        for name in ("e1", "e2"):  # each is promoted in turn, refuses, and is quarantined
            ev = sup.wait(lambda e, n=name: e.topic == f"engine.{n}.quarantined", timeout=60)
            assert ev.data["cause"] == "promote-refused"
            assert "refusing promotion to epoch" in ev.data["detail"]
        assert get(f"{sup.api}/primary")[0] == 503
        assert sup.stop(signal.SIGTERM) == 0
    finally:
        if sup.proc.poll() is None:
            sup.stop(signal.SIGKILL)
