"""A stage's `policy_overrides`: merged onto the policy file, validated like the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from chaos.errors import ScenarioError
from chaos.preflight import preflight
from chaos.scenario import load_scenario
from chaos.stagepolicy import load_stage_policy, merge

ROOT = Path(__file__).resolve().parents[2]
GPU_TP2 = ROOT / "chaos" / "scenarios" / "policy-gpu-tp2.yaml"
ON_CPU = {
    "model": {"path": None, "preset": "tiny"},
    "devices": {"ids": ["cpu", "cpu"], "memory_mb": 1300},
    "cache": {"backend": "memfd"},
}


def test_merge_goes_into_mappings_and_replaces_everything_else() -> None:
    base = {"a": {"b": 1, "c": [1, 2]}, "d": 3}
    assert merge(base, {"a": {"c": [9]}, "e": None}) == {"a": {"b": 1, "c": [9]}, "d": 3, "e": None}
    assert base == {"a": {"b": 1, "c": [1, 2]}, "d": 3}  # the file's data is not changed


def test_the_gpu_tp2_policy_runs_on_cpu_with_only_the_hardware_replaced() -> None:
    policy = load_stage_policy(GPU_TP2, ON_CPU)
    assert policy.model.path is None and policy.model.preset == "tiny"
    assert policy.devices.ids == ["cpu", "cpu"] and policy.cache.backend == "memfd"
    # the rest is the file's own
    assert policy.model.tp_size == 2 and policy.engines.standby == 2
    assert policy.heartbeat.interval_ms == 50 and policy.engines.load.evict_above == 24
    assert policy.model.dtype == "bfloat16" and policy.restart.max_restarts == 200


def _scenario(tmp_path: Path, overrides: str) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(
        f"name: s\nstages:\n  - name: tp2\n    policy: {GPU_TP2}\n"
        f"    policy_overrides: {overrides}\n    faults: [{{kind: kill-tp-rank}}]\n"
    )
    return path


def test_a_bad_override_is_a_policy_error_naming_its_key(tmp_path: Path) -> None:
    plan = load_scenario(_scenario(tmp_path, "{devices: {ids: cpu}}"))
    with pytest.raises(ScenarioError) as err:
        preflight(plan, None)
    assert "$.devices.ids" in str(err.value)


def test_overrides_with_an_attached_supervisor_are_refused(tmp_path: Path) -> None:
    plan = load_scenario(_scenario(tmp_path, "{cache: {backend: memfd}}"))
    with pytest.raises(ScenarioError) as err:
        preflight(plan, None, attached=True)
    assert "policy_overrides" in str(err.value) and "--attach" in str(err.value)


def test_without_overrides_the_gpu_policy_does_not_load_here(tmp_path: Path) -> None:
    plan = load_scenario(_scenario(tmp_path, "{}"))
    with pytest.raises(ScenarioError):
        preflight(plan, None)  # no /tmp/models/llama-8b checkpoint, cuda devices
    on_cpu = (
        "{model: {path: null, preset: tiny}, devices: {ids: [cpu, cpu]}, cache: {backend: memfd}}"
    )
    (policy,) = preflight(load_scenario(_scenario(tmp_path, on_cpu)), None)
    assert policy.model.tp_size == 2
