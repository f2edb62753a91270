"""The chaos CLI: bad input is refused before anything starts; Ctrl-C leaves nothing behind."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from chaos.cli import main
from chaos.procs import descendants, wait_gone

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = ROOT / "chaos" / "scenarios"
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _chaos(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "chaos", *args],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _scenario(
    tmp_path: Path,
    kind: str = "kill-primary",
    check: str = "failed_requests == 0",
    policy: str = str(SCENARIOS / "policy-cpu.yaml"),
) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(
        f"name: t\nstages:\n  - name: main\n    policy: {policy}\n    faults:\n"
        f'      - kind: {kind}\nchecks:\n  - "{check}"\n'
    )
    return path


def test_help_has_an_example() -> None:
    done = _chaos("run", "--help")
    assert done.returncode == 0 and "chaos run chaos/scenarios/smoke.yaml" in done.stdout


def test_unknown_fault_kind_exits_2_naming_the_valid_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert main(["run", str(_scenario(tmp_path, kind="kill-everything")), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "unknown fault kind 'kill-everything'" in err and "stop-primary" in err
    assert not out.exists()  # nothing started, nothing written


def test_bad_check_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", str(_scenario(tmp_path, check="import os; 1 < 2"))]) == 2
    assert "does not read as" in capsys.readouterr().err


def test_policy_that_cannot_start_exits_2_with_its_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "p.yaml"
    bad.write_text("model:\n  preset: tiny\nengines:\n  standby: many\n")
    assert main(["run", str(_scenario(tmp_path, policy=str(bad)))]) == 2
    assert "$.engines.standby" in capsys.readouterr().err


def test_fault_the_policy_cannot_host_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["validate", str(_scenario(tmp_path, kind="kill-tp-rank"))]) == 2
    assert "model.tp_size >= 2" in capsys.readouterr().err


@pytest.mark.slow
def test_ctrl_c_writes_a_partial_report_and_leaves_no_process(tmp_path: Path) -> None:
    out = tmp_path / "out"
    scenario = SCENARIOS / "primary.yaml"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "chaos",
            "run",
            str(scenario),
            "--policy",
            str(SCENARIOS / "policy-broken.yaml"),
            "--trials",
            "5",
            "--out",
            str(out),
            "-v",
            "--no-progress",
        ],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    try:
        deadline = time.monotonic() + 180
        for line in proc.stderr:  # the first fault is logged once the pool is whole
            if "fault" in line and "kill-primary" in line or time.monotonic() > deadline:
                break
        children = descendants(proc.pid)
        assert children, "the suite should be running a broker and a supervisor by now"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
        if proc.stdout is not None:
            proc.stdout.close()
    assert asyncio.run(wait_gone(children, 10.0)) == []
    results = json.loads((out / "results.json").read_text())
    assert not results["meta"]["complete"] and "interrupted" in results["meta"]["note"]
    assert "partial" in (out / "report.md").read_text()


def test_validate_plans_trials_and_max_faults(capsys: pytest.CaptureFixture[str]) -> None:
    soak = str(SCENARIOS / "soak.yaml")
    assert main(["validate", soak]) == 0
    assert "1000 faults" in capsys.readouterr().out
    assert main(["validate", soak, "--max-faults", "7"]) == 0
    assert "ok, 7 faults" in capsys.readouterr().out
    assert main(["validate", soak, "--trials", "2"]) == 0
    assert "ok, 24 faults" in capsys.readouterr().out


def test_report_needs_a_results_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(tmp_path)]) == 2
    assert "results.json" in capsys.readouterr().err


@pytest.mark.parametrize(
    "name", sorted(p.name for p in SCENARIOS.glob("*.yaml") if not p.name.startswith("policy-"))
)
def test_every_shipped_scenario_passes_schema_only_validation(
    name: str, capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On any machine: vLLM's scenario too where vLLM is not installed."""
    monkeypatch.setenv("HOLDFAST_VLLM_VENV", str(tmp_path / "no-vllm"))
    assert main(["validate", str(SCENARIOS / name), "--schema-only"]) == 0
    assert "ok," in capsys.readouterr().out


def test_schema_only_still_finds_policy_errors_and_lists_all_of_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "p.yaml"
    bad.write_text("model:\n  path: /nonexistent/model\nengines:\n  standby: many\n  stanby: 1\n")
    assert main(["validate", str(_scenario(tmp_path, policy=str(bad))), "--schema-only"]) == 2
    err = capsys.readouterr().err
    assert "2 problems" in err and "$.engines.standby" in err and "$.engines.stanby" in err
    assert "config.json" not in err  # the model's files are not looked for
    bad.write_text("model:\n  path: /nonexistent/model\n")
    assert main(["validate", str(_scenario(tmp_path, policy=str(bad))), "--schema-only"]) == 0
    assert main(["validate", str(_scenario(tmp_path, policy=str(bad)))]) == 2
    assert "config.json" in capsys.readouterr().err
