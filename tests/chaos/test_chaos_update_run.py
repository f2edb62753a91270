"""End to end: `update` and `refit` faults against a real supervisor, engines, daemons and
broker, under streamed and collected load: an update and a refit to two generated
checkpoints of other weights, and between them an update to a copy whose config.json the
engine refuses, which must roll back by itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import chaos_run

SCENARIOS = Path(__file__).resolve().parents[2] / "chaos" / "scenarios"
SCENARIO = """
name: update-run
order: fixed
trials: 1
warmup_s: 1.0
settle_s: 0.2
trial_timeout_s: 120
ready_timeout_s: 120
load: {{concurrency: 4, rate: null, max_tokens: 8, ignore_eos: true, stream: true,
       stream_fraction: 0.5, twins: all, twin_prompts: 4, timeout_s: 30}}
stages:
  - name: main
    policy: {policy}
    policy_overrides:
      model: {{dtype: float32}}
      engines: {{command: ["{{python}}", "-m", "engine", "--threads", "1"]}}
      restart: {{max_restarts: 2}}
      update: {{keep_old_s: 0.5, ready_timeout_s: 90}}
    faults:
      - {{kind: update, models: [{{preset: tiny, seed: 1}}, {{preset: tiny, seed: 0}}]}}
      - kind: update
        expect: rolled-back
        models: [{{preset: tiny, config: {{rope_scaling: {{rope_type: bogus, factor: 2.0}}}}}}]
      - {{kind: refit, models: [{{preset: tiny, seed: 1}}, {{preset: tiny, seed: 0}}]}}
checks:
  - "failed_requests == 0"
  - "twin_mismatches == 0"
  - "twin_versions_alike == 0"
  - "versions == 2"
  - "unlabelled_answers == 0"
  - "unserved_versions == 0"
  - "update.unexpected_end == 0"
  - "refit.unexpected_end == 0"
  - "update.rolled_back == 1"
  - "update.pool_copies.max <= 1"
  - "update.peak_pool_copies.min >= 2"
  - "lingering_processes == 0"
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, dict[str, Any]]:
    base = tmp_path_factory.mktemp("update-run")
    path = base / "scenario.yaml"
    path.write_text(SCENARIO.format(policy=SCENARIOS / "policy-cpu.yaml"))
    done, results = chaos_run(path, base / "out", "--no-progress", timeout=600)
    return done.returncode, done.stdout + done.stderr[-3000:], results


@pytest.mark.slow
def test_updates_and_a_refit_alternate_versions_and_a_bad_one_rolls_back(
    run: tuple[int, str, dict[str, Any]],
) -> None:
    code, said, results = run
    assert code == 0, said
    first, bad, refit = results["trials"]
    assert [t["fault"] for t in (first, bad, refit)] == ["update", "update", "refit"]
    assert "update to tiny-seed1; finished" in first["note"]
    assert "refit to tiny-seed0; finished" in refit["note"]  # back: the other one
    assert "rolled-back" in bad["note"] and "quarantined" in bad["note"], bad["note"]
    assert (first["rolled_back"], refit["rolled_back"], bad["rolled_back"]) == (0, 0, 1)
    for trial in (first, bad):
        assert trial["pool_copies"] == 1.0 and trial["peak_pool_copies"] >= 2.0, trial
    fig = results["run"]
    assert len(fig["served_versions"]) == 2 and fig["versions"] == 2
    assert fig["requests"] > 50 and fig["streams"] > 10


@pytest.mark.slow
def test_a_refit_frees_the_old_pool(run: tuple[int, str, dict[str, Any]]) -> None:
    _, _, results = run
    (refit,) = [t for t in results["trials"] if t["fault"] == "refit"]
    assert refit["pool_copies"] == 1.0, refit
