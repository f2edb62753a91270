"""A primary kept above engines.load.evict_above by the load keeps the batch engine evicted.
The run must not wait for that batch engine: every kill-primary trial is injected and
measured, the kill-batch trial is skipped with the load rule as its reason (or, should the
batch engine be back at that instant, injected), and the run completes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = ROOT / "chaos" / "scenarios"


def _busy_policy(tmp_path: Path) -> Path:
    policy = yaml.safe_load((SCENARIOS / "policy-cpu.yaml").read_text())
    # 6 clients back to back keep the primary at ~6 requests in flight: always above 2,
    # never below 1, so the load rule evicts the batch engine and never brings it back
    policy["engines"]["load"] = {"evict_above": 2, "respawn_below": 1, "respawn_hold_s": 30}
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    return path


SCENARIO = """
name: stall
trials: 1
warmup_s: 1.0
settle_s: 0.2
trial_timeout_s: 30
ready_timeout_s: 40
load: {concurrency: 6, rate: 1000, max_tokens: 24, prompt_tokens: 8, retries: 2}
stages:
  - name: main
    policy: policy.yaml
    faults:
      - {kind: kill-primary, trials: 3}
      - {kind: kill-batch}
checks:
  - "kill-primary.promotion_ms.max < 1000"
  - "kill-primary.failed_requests == 0"
"""


@pytest.mark.slow
def test_a_primary_kept_busy_does_not_stall_the_run(tmp_path: Path) -> None:
    _busy_policy(tmp_path)
    scenario = tmp_path / "stall.yaml"
    scenario.write_text(SCENARIO)
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "chaos", "run", str(scenario), "--out", str(out), "--no-progress"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=400,
    )
    results = json.loads((out / "results.json").read_text())
    assert done.returncode == 0, done.stdout + done.stderr[-3000:] + results["meta"]["note"]
    assert results["meta"]["complete"], results["meta"]["note"]
    evicted = [e for e in results["events"] if e["kind"] == "engine" and e["event"] == "evicted"]
    assert evicted, "the load should have evicted the batch engine (the stall's cause)"
    kills = [t for t in results["trials"] if t["fault"] == "kill-primary"]
    assert len(kills) == 3 and all(t["outcome"] == "injected" for t in kills)
    assert all(t["promotion_ms"] is not None for t in kills)
    (batch,) = [t for t in results["trials"] if t["fault"] == "kill-batch"]
    if batch["outcome"] == "skipped":
        # held out by the load rule: above evict_above, or not yet below respawn_below
        assert "load rule" in batch["note"], batch["note"]
        assert "evict_above 2" in batch["note"] or "respawn_below 1" in batch["note"]
        assert "skipped" in (out / "report.md").read_text()
    else:
        assert batch["outcome"] == "injected"
