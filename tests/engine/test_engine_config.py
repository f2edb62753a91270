"""Engine settings from HOLDFAST_* env and flags; `python -m engine --help` (no torch)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.config import EngineConfig, from_args
from engine.errors import EngineError
from engine.launch import REPO

ENV = {
    "HOLDFAST_MODEL": "/models/m",
    "HOLDFAST_NAME": "e1",
    "HOLDFAST_ROLE": "standby",
    "HOLDFAST_PORT": "9001",
    "HOLDFAST_EPOCH": "7",
    "HOLDFAST_AGENT": "ipc:///run/agents",
    "HOLDFAST_DAEMONS": "/run/daemon-0.sock,/run/daemon-1.sock",
    "HOLDFAST_RANK": "1",
    "HOLDFAST_WORLD_SIZE": "2",
    "HOLDFAST_DTYPE": "float16",
}


def test_the_supervisor_environment_is_read_whole() -> None:
    cfg = from_args([], ENV)
    assert cfg == EngineConfig(
        model="/models/m",
        name="e1",
        role="standby",
        port=9001,
        epoch=7,
        agent="ipc:///run/agents",
        rank=1,
        world_size=2,
        daemons=("/run/daemon-0.sock", "/run/daemon-1.sock"),
        dtype="float16",
    )
    assert cfg.socket == "/run/daemon-1.sock"


def test_flags_win_over_the_environment() -> None:
    cfg = from_args(["--port", "9100", "--role", "batch", "--epoch", "9"], ENV)
    assert (cfg.port, cfg.role, cfg.epoch, cfg.name) == (9100, "batch", 9, "e1")


def test_threads_default_to_torchs_own_and_a_flag_sets_them() -> None:
    assert from_args([], ENV).threads == 0
    assert from_args(["--threads", "1"], ENV).threads == 1


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        ([], {}, "pass --model DIR or set HOLDFAST_MODEL"),
        (["--model", "m"], {}, "pass --daemons SOCK"),
        ([], {**ENV, "HOLDFAST_ROLE": "leader"}, "--role/HOLDFAST_ROLE 'leader' is not one of"),
        ([], {**ENV, "HOLDFAST_PORT": "http"}, "HOLDFAST_PORT='http' is not a valid int"),
        ([], {**ENV, "HOLDFAST_WORLD_SIZE": "4"}, "names 2 sockets; give one per rank (4)"),
        (["--quantization", "int4"], ENV, "--quantization/HOLDFAST_QUANTIZATION 'int4'"),
        (["--model-impl", "hf"], ENV, "--model-impl hf serves at --world-size 1 only"),
        (["--peer-stale-s", "0.5"], ENV, "--peer-stale-s must be a number of seconds, at least 1"),
        (["--peer-stale-s", "nan"], ENV, "at least 1 (got nan)"),
        (["--threads", "-1"], ENV, "--threads must be 0 (torch's default) or more (got -1)"),
    ],
)
def test_bad_settings_name_what_to_change(
    argv: list[str], env: dict[str, str], message: str
) -> None:
    with pytest.raises(EngineError, match=message.replace("(", r"\(").replace(")", r"\)")):
        from_args(argv, env)


def test_help_has_an_example_and_bad_settings_exit_2() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "engine", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and "example:" in out.stdout and "python -m engine" in out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "engine", "--model", "/nowhere"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "--allow-disk-fallback" in bad.stderr
