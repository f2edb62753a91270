"""The cachedaemon command line: status, parity, make-checkpoint, help."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.conftest import child_env


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cachedaemon", *args],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=120,
    )


def test_status_and_parity_against_a_live_daemon(
    tiny_model: Path, tmp_path: Path, start_daemon: Any
) -> None:
    start_daemon(tiny_model, tmp_path / "run", "--quantization", "fp8-block")
    sock = str(tmp_path / "run" / "daemon-0.sock")
    status = cli("status", "--socket", sock, "--json")
    assert status.returncode == 0, status.stderr
    data = json.loads(status.stdout)
    assert data["tensors"] == 21 + 14 and data["backend"] == "memfd"
    assert data["config"]["quantization"] == "fp8-block" and not data["adopted"]
    parity = cli("parity", "--model", str(tiny_model), "--socket", sock)
    assert parity.returncode == 0, parity.stdout + parity.stderr
    assert "35 tensors on disk, 35 in pool, 0 differences" in parity.stdout


def test_status_of_a_missing_daemon_says_which_socket(tmp_path: Path) -> None:
    out = cli("status", "--socket", str(tmp_path / "none.sock"))
    assert out.returncode == 2 and f"nothing answers on {tmp_path / 'none.sock'}" in out.stderr


def test_make_checkpoint_is_deterministic_and_refuses_to_overwrite(tmp_path: Path) -> None:
    for name in ("a", "b"):
        assert (
            cli(
                "make-checkpoint", str(tmp_path / name), "--preset", "tiny", "--seed", "3"
            ).returncode
            == 0
        )
    a, b = (tmp_path / n / "model.safetensors" for n in ("a", "b"))
    assert a.read_bytes() == b.read_bytes()
    again = cli("make-checkpoint", str(tmp_path / "a"), "--preset", "tiny")
    assert again.returncode == 2 and "is not empty" in again.stderr
    assert a.read_bytes() == b.read_bytes()  # nothing overwritten
    bad = cli("make-checkpoint", str(tmp_path / "c"), "--preset", "huge")
    assert bad.returncode == 2 and "choose one of tiny, small, llama-8b, moe" in bad.stderr


def test_serve_rejects_bad_arguments_before_loading(tiny_model: Path, tmp_path: Path) -> None:
    out = cli(
        "serve",
        "--model",
        str(tiny_model),
        "--runtime-dir",
        str(tmp_path / "r"),
        "--quantization",
        "awq",
    )
    assert out.returncode == 2 and "allowed: none, fp8-block" in out.stderr
    assert not (tmp_path / "r").exists()
    out = cli("serve", "--model", str(tmp_path / "nope"), "--runtime-dir", str(tmp_path / "r"))
    assert out.returncode == 2 and "does not exist; pass --model" in out.stderr


def test_every_command_has_help_with_an_example() -> None:
    for cmd in ("serve", "status", "keeper", "make-checkpoint", "parity"):
        out = cli(cmd, "--help")
        assert (
            out.returncode == 0 and "example:" in out.stdout and f"cachedaemon {cmd}" in out.stdout
        )


def test_failures_are_not_logged_as_done(tiny_model: Path, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    made = cli("make-checkpoint", str(tmp_path / "file" / "out"), "--preset", "tiny")
    assert made.returncode == 2, made.stderr
    assert ": done" not in made.stderr and "Traceback" not in made.stderr, made.stderr
    assert made.stderr.splitlines()[-1] == (
        f"cachedaemon make-checkpoint: error: cannot write {tmp_path / 'file' / 'out'}: "
        "Not a directory; pass an OUT dir you can create"
    )
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny_model.iterdir():
        data = f.read_bytes()
        (broken / f.name).write_bytes(
            data[: len(data) // 2] if f.suffix == ".safetensors" else data
        )
    served = cli("serve", "--model", str(broken), "--runtime-dir", str(tmp_path / "r"))
    assert served.returncode == 2, served.stderr
    assert ": done" not in served.stderr, served.stderr
    assert "loading broken: stopped" in served.stderr
    assert "the file is truncated" in served.stderr.splitlines()[-1]
