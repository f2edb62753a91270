"""gpu-tp2.yaml's policy, run on this CPU machine with gloo: a tensor-parallel pair per
engine, standbys, heartbeat, restart and load rules all from policy-gpu-tp2.yaml itself;
only what cannot exist here is replaced through the stage's `policy_overrides` (the model,
the devices, the cache backend, memory figures scaled to fit). Its kill-primary and
kill-tp-rank faults, fewer trials, under load: every trial promotes a standby group, the
whole killed group goes down, no request fails, and the file's promotion bar holds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import chaos_run

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = ROOT / "chaos" / "scenarios"
GPU_SCENARIO = SCENARIOS / "gpu-tp2.yaml"
TRIALS = {"kill-primary": 3, "kill-tp-rank": 1}  # trials here (the GPU scenario runs 20 and 5)
MEMORY_SCALE = 100  # the GPU figures (MB) over this: 8 engine processes on a 23 GB box


def _overrides(policy: dict[str, Any]) -> dict[str, Any]:
    """What cannot exist on this machine, replaced; everything else stays the file's."""
    engines = policy["engines"]
    return {
        "model": {"path": None, "preset": "tiny"},
        "devices": {
            "ids": ["cpu"] * policy["model"]["tp_size"],
            "memory_mb": policy["devices"]["memory_mb"] // MEMORY_SCALE,
        },
        "cache": {"backend": "memfd"},
        "engines": {
            "memory_mb": engines["memory_mb"] // MEMORY_SCALE,
            "batch": [{**b, "memory_mb": b["memory_mb"] // MEMORY_SCALE} for b in engines["batch"]],
        },
    }


def _checks(gpu: list[str]) -> list[str]:
    """gpu-tp2.yaml's own bars on the faults run here (promotion p99, failed requests,
    group_left), and no process left behind; not its counts of 20 trials."""
    mine = [c for c in gpu if c.split(".")[0] in TRIALS and ".count" not in c]
    assert any("promotion_ms" in c for c in mine) and any("group_left" in c for c in mine)
    return [*mine, "lingering_processes == 0"]


def _scenario(tmp_path: Path) -> Path:
    gpu = yaml.safe_load(GPU_SCENARIO.read_text())
    (stage,) = gpu["stages"]
    policy_file = (GPU_SCENARIO.parent / stage["policy"]).resolve()
    faults = [{**f, "trials": TRIALS[f["kind"]]} for f in stage["faults"] if f["kind"] in TRIALS]
    assert {f["kind"] for f in faults} == set(TRIALS), "gpu-tp2.yaml no longer has these faults"
    load = {
        **gpu["load"],
        "concurrency": 4,  # 2 cores serve 8 engine processes: a shorter request, fewer clients
        "prompt_tokens": 8,
        "max_tokens": 8,
        "rate": None,
        "timeout_s": 30,
    }
    scenario = {
        "name": "gpu-tp2-cpu",
        "seed": gpu["seed"],
        "order": "fixed",
        "warmup_s": 1.0,
        "settle_s": gpu["settle_s"],
        "trial_timeout_s": 45,
        "detect_timeout_s": gpu["detect_timeout_s"],
        "ready_timeout_s": 60,
        "start_timeout_s": 120,
        "load": load,
        "stages": [
            {
                "name": "tp2",
                "policy": str(policy_file),
                "policy_overrides": _overrides(yaml.safe_load(policy_file.read_text())),
                "faults": faults,
            }
        ],
        "checks": _checks(gpu["checks"]),
    }
    path = tmp_path / "gpu-tp2-cpu.yaml"
    path.write_text(yaml.safe_dump(scenario, sort_keys=False))
    return path


@pytest.mark.slow
def test_gpu_tp2_policy_fails_over_on_cpu_with_gloo(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done, results = chaos_run(_scenario(tmp_path), out, "--no-progress")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:] + results["meta"]["note"]
    ran = yaml.safe_load((out / "tp2" / "policy.yaml").read_text())
    assert ran["model"]["tp_size"] == 2 and ran["cache"]["backend"] == "memfd"
    trials = results["trials"]
    assert sorted(t["fault"] for t in trials) == sorted(
        k for k, n in TRIALS.items() for _ in range(n)
    )
    promotions = {t["fault"]: [] for t in trials}
    for t in trials:
        assert t["outcome"] == "injected", t
        assert t["promotion_ms"] is not None, t  # a standby group was promoted
        assert t["failed_requests"] == 0, t
        assert t["group_left"] == 0, t  # no rank of the killed group survived
        promotions[t["fault"]].append(t["promotion_ms"])
    assert results["run"]["failed_requests"] == 0
    print("promotion_ms", promotions)
    assert {c["check"] for c in results["checks"]} >= {"kill-primary.promotion_ms.p99 < 100"}
    assert all(c["passed"] for c in results["checks"]), results["checks"]
