"""CacheConfig: every single field is part of the identity."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from cachedaemon.config import (
    CacheConfig,
    EnvStamp,
    FileIdentity,
    checkpoint_changes,
    make_config,
)
from cachedaemon.errors import CacheError, QuantizationError

FILE = FileIdentity(
    "model.safetensors", 10, 1_700_000_000_000_000_000, 1_700_000_000_000_000_001, 7, 64
)


def base() -> CacheConfig:
    return CacheConfig(
        checkpoint=(FILE,),
        architecture="LlamaForCausalLM",
        dtype="bfloat16",
        tp_size=2,
        tp_rank=0,
        quantization="none",
        quant_config_hash="q",
        shard_plan_hash="s",
        backend="memfd",
        device="cpu",
        env=EnvStamp("2.13.0", "", "", "0.1.0"),
    )


CHANGES = {
    "checkpoint": (msgspec.structs.replace(FILE, size=11),),
    "architecture": "Qwen2ForCausalLM",
    "dtype": "float16",
    "tp_size": 4,
    "tp_rank": 1,
    "quantization": "fp8-block",
    "quant_config_hash": "q2",
    "shard_plan_hash": "s2",
    "backend": "cuda-vmm",
    "device": "cuda:0",
    "env": EnvStamp("2.13.0", "12.8", "", "0.1.0"),
    "layout": "vllm 0.32.0",
}


def test_changes_cover_every_field() -> None:
    assert set(CHANGES) == set(CacheConfig.__struct_fields__)


@pytest.mark.parametrize("field", sorted(CHANGES))
def test_any_single_field_changes_the_fingerprint(field: str) -> None:
    a = base()
    b = msgspec.structs.replace(a, **{field: CHANGES[field]})
    assert a.fingerprint() != b.fingerprint()
    assert a.diff(b)[0].split(".")[0] == field


@pytest.mark.parametrize("sub", EnvStamp.__struct_fields__)
def test_each_env_stamp_field_changes_the_fingerprint(sub: str) -> None:
    a = base()
    b = msgspec.structs.replace(a, env=msgspec.structs.replace(a.env, **{sub: "other"}))
    assert a.fingerprint() != b.fingerprint()
    assert a.diff(b) == [f"env.{sub}"]


@pytest.mark.parametrize("sub", FileIdentity.__struct_fields__)
def test_each_stat_fact_of_a_checkpoint_file_changes_the_fingerprint(sub: str) -> None:
    a = base()
    other = "other.safetensors" if sub == "name" else getattr(FILE, sub) + 1
    b = msgspec.structs.replace(a, checkpoint=(msgspec.structs.replace(FILE, **{sub: other}),))
    assert a.fingerprint() != b.fingerprint()
    assert a.diff(b) == ["checkpoint"]


def test_a_rewrite_in_place_changes_the_checkpoint_identity(tmp_path: Path) -> None:
    from cachedaemon.checkpoint_gen import make_checkpoint
    from tests.identity_checkpoints import scale_in_place

    model = make_checkpoint(tmp_path / "tiny", "tiny")
    before = make_config(model)
    scale_in_place(model)
    after = make_config(model)
    assert before.fingerprint() != after.fingerprint()
    assert checkpoint_changes(after, before) == ["model.safetensors: mtime_ns, ctime_ns differ"]


def test_same_config_same_fingerprint(tiny_model: Path) -> None:
    assert make_config(tiny_model).fingerprint() == make_config(tiny_model).fingerprint()
    assert make_config(tiny_model).diff(make_config(tiny_model, tp_size=2)) == ["tp_size"]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"quantization": "int4-awq"}, QuantizationError, "allowed: none, fp8-block"),
        ({"dtype": "int8"}, CacheError, "choose one of bfloat16, float16, float32"),
        ({"tp_size": 2, "tp_rank": 2}, CacheError, "--tp-rank 2"),
        ({"backend": "cuda-vmm"}, CacheError, "does not serve device"),
    ],
)
def test_bad_arguments_name_what_to_change(
    tiny_model: Path, kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        make_config(tiny_model, **kwargs)  # type: ignore[arg-type]
