"""`engines.kind: vllm` on a GPU, as far as it is decided before any GPU is touched: each
engine's KV cache sized by the policy (not by vLLM's profiling of free memory that other
engines' starts are changing), and the bad input refused by `supervisor validate` with what
to change: a KV cache that does not fit an engine's memory, a pool and engines that do not
fit the device, a vLLM release the plugin is not tested with."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from holdfast_vllm import TESTED_VLLM, UNTESTED_ENV
from supervisor.policy_file import load_policy

ROOT = Path(__file__).resolve().parents[2]


def gpu_policy(tmp_path: Path, **overrides: Any) -> Path:
    model = tmp_path / "m"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    if not (model / "model.safetensors").exists():
        (model / "model.safetensors").write_bytes(b"")
    policy: dict[str, Any] = {
        "model": {"path": str(model), "dtype": "bfloat16"},
        "devices": {"ids": ["cuda:0"], "memory_mb": 76000},
        "cache": {"backend": "cuda-vmm", "runtime_dir": str(tmp_path / "run")},
        "engines": {"kind": "vllm", "vllm": {"kv_cache_gb": 8}, "memory_mb": 12000, "standby": 1},
    }
    for section, values in overrides.items():
        policy[section] = {**policy.get(section, {}), **values}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(policy))
    return path


def validate(policy: Path, *flags: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor", "validate", *flags, str(policy)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, **env},
    )


def test_a_gpu_engine_gets_the_kv_cache_the_policy_sizes(tmp_path: Path) -> None:
    cmd = load_policy(gpu_policy(tmp_path), schema_only=True).engines.command
    assert cmd[cmd.index("--kv-cache-memory-bytes") + 1] == str(8 * 2**30)
    assert cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.05"
    cpu = gpu_policy(tmp_path, devices={"ids": ["cpu"]}, cache={"backend": "memfd"})
    assert "--kv-cache-memory-bytes" not in load_policy(cpu, schema_only=True).engines.command


def test_a_kv_cache_larger_than_an_engines_memory_is_refused(tmp_path: Path) -> None:
    policy = gpu_policy(tmp_path, engines={"memory_mb": 6000})
    cp = validate(policy, "--schema-only")
    assert cp.returncode == 2, cp.stdout + cp.stderr
    assert "$.engines.memory_mb: 6000 MB per engine cannot hold engines.vllm.kv_cache_gb 8" in (
        cp.stderr
    )
    assert "raise engines.memory_mb above 8192 or lower engines.vllm.kv_cache_gb" in cp.stderr


def test_weights_and_engines_that_do_not_fit_the_device_are_refused(tmp_path: Path) -> None:
    policy = gpu_policy(tmp_path, devices={"memory_mb": 30000})
    with (tmp_path / "m" / "model.safetensors").open("wb") as f:
        f.truncate(16 * 2**30)  # sparse: the size of llama-8b's bf16 weights, no disk used
    cp = validate(policy, HOLDFAST_VLLM_VENV=str(tmp_path / "none"))
    assert cp.returncode == 2, cp.stdout + cp.stderr
    assert (
        "$.devices.memory_mb: 30000 MB cannot hold the weights (16384 MB, once) and 2 engines "
        "of engines.memory_mb 12000 MB (40384 MB in all)"
    ) in cp.stderr
    roomy = gpu_policy(tmp_path, devices={"memory_mb": 76000})
    assert "cannot hold the weights" not in validate(roomy).stderr


def test_a_vllm_release_the_plugin_is_not_tested_with_is_refused(tmp_path: Path) -> None:
    site = tmp_path / "site" / "vllm"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("")
    (site / "_version.py").write_text('__version__ = version = "0.27.1"\n')
    python = tmp_path / "python"
    path = f"{tmp_path / 'site'}:{ROOT}"
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{path}" exec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    policy = gpu_policy(tmp_path, engines={"vllm": {"kv_cache_gb": 8, "python": str(python)}})
    cp = validate(policy)
    assert cp.returncode == 2, cp.stdout + cp.stderr
    tested = " and ".join(TESTED_VLLM)
    assert f"holdfast_vllm is tested with vLLM {tested}, not 0.27.1" in cp.stderr
    assert f"or set {UNTESTED_ENV}=1" in cp.stderr
    assert "tested with vLLM" not in validate(policy, **{UNTESTED_ENV: "1"}).stderr
