"""What vLLM's engine asks of a pool, as holdfast's CacheConfig: torch only, no vLLM."""

from __future__ import annotations

from pathlib import Path

import torch

from cachedaemon.config import DTYPES, CacheConfig, make_config
from holdfast_vllm.errors import PluginError


def dtype_name(dtype: torch.dtype) -> str:
    """vLLM's model dtype as a daemon's --dtype (`torch.bfloat16` -> "bfloat16")."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise PluginError(
            f"vLLM runs the model in {name}; a holdfast pool holds one of {', '.join(DTYPES)}: "
            "pass vLLM --dtype float32, bfloat16 or float16"
        )
    return name


def device_name(device: torch.device) -> str:
    """ "cpu", or "cuda:N" with the index made explicit (a daemon serves one device)."""
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else 0}"
    raise PluginError(
        f"--load-format holdfast serves cpu and cuda engines, not {device.type}; "
        "use vLLM's default loader there"
    )


def cache_config(
    model: str | Path,
    dtype: torch.dtype,
    rank: int,
    world_size: int,
    device: torch.device,
    layout: str = "reference",
) -> CacheConfig:
    """The fingerprint this rank's daemon must match: checkpoint, dtype, TP rank, device,
    layout (cachedaemon/layouts.py)."""
    model_dir = Path(model)
    if not (model_dir / "config.json").is_file():
        raise PluginError(
            f"--model {model} is not a local checkpoint dir (no config.json): holdfast "
            "identifies a pool by the checkpoint's files; pass the dir the daemon serves"
        )
    return make_config(
        model_dir,
        dtype=dtype_name(dtype),
        tp_size=world_size,
        tp_rank=rank,
        device=device_name(device),
        layout=layout,
    )
