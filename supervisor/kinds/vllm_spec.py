"""The policy's `engines.vllm` section: how the supervisor starts vLLM API servers.

Read only when `engines.kind` is `vllm` (supervisor/kinds/vllm.py expands it into the
engine command and environment). It imports nothing of the supervisor.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import msgspec

DEFAULT_VENV = "/opt/holdfast/vllm-venv"  # where scripts/install-vllm.sh installs vLLM
VENV_ENV = "HOLDFAST_VLLM_VENV"  # a venv elsewhere; engines.vllm.python overrides both


class VllmSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # the interpreter that has vLLM; "": $HOLDFAST_VLLM_VENV/bin/python, else
    # /opt/holdfast/vllm-venv/bin/python
    python: str = ""
    # holdfast: attach the weights from the pool's daemons (the holdfast_vllm plugin);
    # auto: vLLM reads the checkpoint itself, as without holdfast
    loader: Literal["holdfast", "auto"] = "holdfast"
    mode: Literal["zero_copy", "copy"] = "zero_copy"  # the plugin's: views of the pool or copies
    # with loader holdfast: vllm, the daemons build the pool in vLLM's layout (fused
    # qkv_proj, gate_up_proj) with this python, and every weight of an engine is a view of
    # it; reference, the checkpoint's tensors, vLLM's fused parameters private copies
    layout: Literal["vllm", "reference"] = "vllm"
    fallback: bool = True  # the plugin loads from disk when no daemon answers or it mismatches
    # each engine's KV cache (GiB, at least 1): VLLM_CPU_KVCACHE_SPACE on CPU; on a GPU
    # --kv-cache-memory-bytes, so vLLM does not size it by profiling the free memory that
    # the pool and the other engines' starts are changing
    kv_cache_gb: int = 1
    # on a GPU: only vLLM's start-up check reads it (the card's free memory must be at
    # least this share of its total), since kv_cache_gb sizes the KV cache
    gpu_memory_utilization: float = 0.05
    max_model_len: int = 0  # 0: the checkpoint's max_position_embeddings
    enforce_eager: bool = True  # no torch.compile: ready in seconds, not after a compile
    # the API server forks its EngineCore (imports done) instead of spawning it, as vLLM's
    # CPU platform does (holdfast_vllm.core_fork.fork_engine_core)
    fork_engine_core: bool = True
    args: list[str] = msgspec.field(default_factory=list)  # more flags; placeholders allowed
    # how often the primary's /metrics is read for the load rule (engines.load)
    metrics_interval_ms: int = 200
    # KV cache usage (0..1) at or above which the primary counts as over evict_above
    kv_evict_above: float = 0.95


def python_of(spec: VllmSpec) -> str:
    """The interpreter vLLM engines run on."""
    if spec.python:
        return spec.python
    return str(Path(os.environ.get(VENV_ENV) or DEFAULT_VENV) / "bin" / "python")
