"""What refuses a rolling update before anything changes, each refusal naming what to fix:
an update under way, a fleet node, a dir that is not a checkpoint, the same version again,
or a checkpoint of another architecture or other shapes than the one that serves (an
update keeps the model's architecture and every tensor's shape: the engines' KV cache,
their batch shapes and the router's continuations are made for them). Reads config.json
and the safetensors headers only, never a tensor."""

from __future__ import annotations

from pathlib import Path

from cachedaemon.checkpoint import read_header, read_hf_config, safetensors_files
from cachedaemon.errors import CacheError
from supervisor.policy import checkpoint_errors

# config.json keys that name the architecture, and those that fix the tensors' shapes
ARCHITECTURE = ("architectures", "model_type")
SHAPES = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
)
SHOWN = 4  # differing tensors named in a refusal


def checkpoint_refusals(running: Path, new: Path) -> list[str]:
    """Why `new` cannot replace `running` by an update ([] when it can)."""
    errors = checkpoint_errors(new, key="--model")
    if errors:
        return errors
    try:
        old_cfg, new_cfg = read_hf_config(running), read_hf_config(new)
        old_shapes, new_shapes = _shapes(running), _shapes(new)
    except CacheError as e:
        return [f"--model: {new} is not a readable checkpoint: {e}"]
    fix = "an update keeps the model; start a supervisor with the other model instead"
    for key in ARCHITECTURE:
        if old_cfg.get(key) != new_cfg.get(key):
            return [
                f"--model: {new} holds {key} {new_cfg.get(key)!r}, the running model "
                f"{old_cfg.get(key)!r} ({running}); {fix}"
            ]
    differ = [
        f"{key} {new_cfg.get(key)!r} (running: {old_cfg.get(key)!r})"
        for key in SHAPES
        if old_cfg.get(key) != new_cfg.get(key)
    ]
    differ += _tensor_differences(old_shapes, new_shapes)
    if differ:
        return [
            f"--model: {new} has other shapes than the running model: {'; '.join(differ)}; {fix}"
        ]
    return []


def _shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, by name, from the safetensors headers."""
    return {t.name: t.shape for f in safetensors_files(model_dir) for t in read_header(f)}


def _tensor_differences(
    old: dict[str, tuple[int, ...]], new: dict[str, tuple[int, ...]]
) -> list[str]:
    lines = [f"tensor {n} missing" for n in sorted(old.keys() - new.keys())]
    lines += [f"tensor {n} not in the running model" for n in sorted(new.keys() - old.keys())]
    lines += [
        f"tensor {n} {list(new[n])} (running: {list(old[n])})"
        for n in sorted(old.keys() & new.keys())
        if old[n] != new[n]
    ]
    if len(lines) > SHOWN:
        lines = [*lines[:SHOWN], f"{len(lines) - SHOWN} more tensors"]
    return lines
