"""ModelArgs: the part of a checkpoint's config.json a Llama-family decoder needs.

Reads Llama, Mistral and Qwen2 configs (Qwen2 adds q/k/v biases). Anything this engine
cannot compute faithfully (another architecture, an unknown rope scaling) is refused with
the field to change, rather than served wrong.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from engine.errors import ModelConfigError

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
ROPE_TYPES = ("default", "llama3")


class RopeScaling(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


class ModelArgs(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]


def _rope(hf: dict[str, Any]) -> tuple[float, RopeScaling]:
    params = hf.get("rope_parameters") or {}
    scaling = dict(hf.get("rope_scaling") or params)
    theta = float(hf.get("rope_theta") or params.get("rope_theta") or 10000.0)
    kind = str(scaling.get("rope_type") or scaling.get("type") or "default")
    if kind not in ROPE_TYPES:
        raise ModelConfigError(
            f"config.json rope_scaling type {kind!r} is not supported; "
            f"supported: {', '.join(ROPE_TYPES)}"
        )
    keep = {k: v for k, v in scaling.items() if k in RopeScaling.__struct_fields__}
    keep["rope_type"] = kind
    return theta, msgspec.convert(keep, RopeScaling)


def _eos(hf: dict[str, Any], model_dir: Path) -> tuple[int, ...]:
    raw = hf.get("eos_token_id")
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        raw = json.loads(gen.read_text()).get("eos_token_id", raw)
    if raw is None:
        return ()
    return tuple(raw) if isinstance(raw, list) else (int(raw),)


def parse(hf: dict[str, Any], model_dir: Path) -> ModelArgs:
    archs = hf.get("architectures") or []
    arch = str(archs[0]) if archs else ""
    if arch not in ARCHITECTURES:
        raise ModelConfigError(
            f"{model_dir}/config.json architectures={archs!r}: the llama engine serves "
            f"{', '.join(ARCHITECTURES)}; use --model-impl hf for other models"
        )
    try:
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        theta, scaling = _rope(hf)
        return ModelArgs(
            architecture=arch,
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            vocab_size=int(hf["vocab_size"]),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(hf.get("attention_bias")),
            eos_token_ids=_eos(hf, model_dir),
        )
    except KeyError as e:
        raise ModelConfigError(f"{model_dir}/config.json has no field {e.args[0]!r}") from None


def read_model_args(model_dir: str | Path) -> ModelArgs:
    path = Path(model_dir) / "config.json"
    try:
        hf = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelConfigError(f"cannot read {path}: {e}; pass --model a checkpoint dir") from e
    return parse(hf, Path(model_dir))


def check_tp(args: ModelArgs, tp: int) -> None:
    """Raise unless every sharded dimension divides evenly by the tensor-parallel size."""
    dims = {
        "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_key_value_heads,
        "intermediate_size": args.intermediate_size,
        "vocab_size": args.vocab_size,
    }
    for name, value in dims.items():
        if value % tp:
            raise ModelConfigError(
                f"config.json {name}={value} does not split over "
                f"--world-size {tp}; pick a size that divides it"
            )
