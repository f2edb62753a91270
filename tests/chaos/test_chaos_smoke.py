"""End to end: the smoke scenario against a real supervisor, engines, daemons and broker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from chaos.fleet.kinds import FLEET_FAULTS
from chaos.scenario import FAULTS

NODE_FAULTS = [k for k in FAULTS if k not in FLEET_FAULTS]  # fleet kinds: fleet.yaml

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = ROOT / "chaos" / "scenarios"


def _chaos(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "chaos", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_smoke_scenario_passes_and_reports_every_fault_kind(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = _chaos(
        "run", str(SCENARIOS / "smoke.yaml"), "--out", str(out), "--no-progress", timeout=600
    )
    report = (out / "report.md").read_text()
    assert done.returncode == 0, done.stdout + done.stderr[-3000:] + report
    for kind in NODE_FAULTS:
        assert f"### {kind} (" in report, kind
    results = json.loads((out / "results.json").read_text())
    assert {t["fault"] for t in results["trials"]} == set(NODE_FAULTS)
    assert results["meta"]["complete"] and results["run"]["lingering_processes"] == 0
    assert all(c["passed"] for c in results["checks"]) and len(results["checks"]) >= 10
    assert results["run"]["requests"] > 500
    promoted = [t for t in results["trials"] if t["fault"] == "kill-primary"]
    assert promoted and all(t["promotion_ms"] is not None for t in promoted)
    assert {e["source"] for e in results["events"]} == {"zmq", "mqtt"}
    for png in ("timeline.png", "recovery.png"):
        assert (out / png).stat().st_size > 10_000


@pytest.mark.slow
def test_no_standby_fails_the_primary_checks_with_exit_1(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = _chaos(
        "run",
        str(SCENARIOS / "primary.yaml"),
        "--policy",
        str(SCENARIOS / "policy-broken.yaml"),
        "--trials",
        "1",
        "--out",
        str(out),
        "--no-progress",
        timeout=300,
    )
    assert done.returncode == 1, done.stdout + done.stderr[-3000:]
    assert "FAIL  kill-primary.promotion_ms.p99 < 100" in done.stdout
    results = json.loads((out / "results.json").read_text())
    failed = {c["check"] for c in results["checks"] if not c["passed"]}
    assert "kill-primary.promotion_ms.p99 < 100" in failed
    assert "**FAIL**" in (out / "report.md").read_text()
