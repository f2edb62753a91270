"""What a new user runs into in the first hour gets a clear error naming what to change, never
a traceback: every policy error in one run, a runtime dir that is a file, a checkpoint
without weights, a daemon that dies at start, a reader that closes the pipe early; and a
clean stop leaves no spare's file behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.errors import PolicyError, RuntimeDirError
from supervisor.policy_file import parse_policy
from supervisor.runtime import RuntimeDir
from tests.engines.harness import Supervisor, env, write_policy


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args],
        env=env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_type_errors_and_rule_errors_come_in_one_run(tmp_path: Path) -> None:
    with pytest.raises(PolicyError) as info:
        parse_policy(
            "model: {preset: tiny}\n"
            "engines: {primary: 2, standby: two, colour: red}\n"
            "heartbeat: {interval_ms: -5, miss_limit: many}\n"
            "router: {listen: nowhere}\n",
            tmp_path / "p.yaml",
        )
    errors = info.value.errors
    assert "$.engines.standby: expected int, got str" in errors
    assert "$.heartbeat.miss_limit: expected int, got str" in errors
    assert any(e.startswith("$.engines.colour: unknown key") for e in errors)
    assert "$.engines.primary: got 2, must be 1 (one primary at a time)" in errors
    assert "$.heartbeat.interval_ms: must be at least 1" in errors
    assert "$.router.listen: 'nowhere' is not HOST:PORT (like 127.0.0.1:8000)" in errors
    assert len(errors) == 6, errors  # nothing said about a value whose type was wrong


def test_a_checkpoint_dir_without_safetensors_fails_validate(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    policy = write_policy(tmp_path / "p.yaml", model, tmp_path / "run")
    cp = cli("supervisor", "validate", str(policy))
    assert cp.returncode == 2
    assert f"$.model.path: {model} holds no *.safetensors" in cp.stderr
    (model / "model.safetensors").write_bytes(b"")
    assert cli("supervisor", "validate", str(policy)).returncode == 0


def test_a_runtime_dir_that_is_a_file_is_named_not_a_traceback(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("mine")
    for run in (afile, afile / "sub"):
        with pytest.raises(RuntimeDirError, match=f"{run}.*set cache.runtime_dir"):
            RuntimeDir.acquire(run)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    cp = cli("supervisor", "run", str(write_policy(tmp_path / "p.yaml", model, afile)))
    assert cp.returncode == 2 and "Traceback" not in cp.stderr
    assert f"$.cache.runtime_dir: {afile} is not a directory" in cp.stderr
    for run in (afile, afile / "sub"):
        cp = cli("supervisor", "status", "--runtime-dir", str(run))
        assert cp.returncode == 1
        assert cp.stderr.splitlines() == [
            f"supervisor: runtime dir {run} is not a directory; give --runtime-dir the dir "
            "`supervisor run` uses (its policy's cache.runtime_dir), or pass --policy"
        ]
    assert afile.read_text() == "mine"


@pytest.mark.parametrize(
    "argv",
    [["chaos", "kinds"], ["supervisor", "validate"]],
    ids=" ".join,
)
def test_a_reader_that_closes_the_pipe_ends_the_command_quietly(argv: list[str]) -> None:
    r, w = os.pipe()
    os.close(r)  # like `| head` that has read its lines and gone
    try:
        cp = subprocess.run(
            [sys.executable, "-m", *argv],
            env=env(),
            stdout=w,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(w)
    assert cp.stderr == ""
    assert cp.returncode == 128 + signal.SIGPIPE


def processes_naming(text: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and text in (proc / "cmdline").read_text():
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def test_a_daemon_that_dies_at_start_is_reported_dead_not_timed_out(
    tmp_path: Path, tiny_model: Path
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text((tiny_model / "config.json").read_text())
    (model / "model.safetensors").write_bytes(b"not safetensors")
    run = tmp_path / "run"
    policy = write_policy(tmp_path / "p.yaml", model, run, cache={"ready_timeout_s": 600})
    cp = cli("supervisor", "run", str(policy), timeout=300)
    assert cp.returncode == 1
    error = cp.stderr[cp.stderr.index("supervisor: cache daemon") :]
    assert error.startswith("supervisor: cache daemon rank 0 died ")
    assert "before it served (exit status 2)" in error
    assert f"its last log lines ({run / 'logs' / 'daemon-0.log'})" in error
    assert "model.safetensors" in error  # the daemon's own words on what is wrong
    assert "ready_timeout_s" not in error
    assert processes_naming(str(run)) == []


def test_a_clean_stop_leaves_no_spare_file(tmp_path: Path, tiny_model: Path) -> None:
    run = tmp_path / "run"
    sup = Supervisor(write_policy(tmp_path / "p.yaml", tiny_model, run))
    try:
        ready = sup.wait(lambda e: e.kind == "daemon" and e.event == "spare_ready", timeout=240)
        spare = run / "daemon-0.spare"
        assert json.loads(spare.read_text())["pid"] == ready.data["pid"]
    finally:
        code = sup.stop()
    assert code == 0, sup.output()
    assert not spare.exists()
    assert processes_naming(str(run)) == []
