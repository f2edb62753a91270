"""Checkpoint reading, TP sharding and fp8-block: right values, and clear errors on bad input."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cachedaemon.checkpoint import CheckpointReader
from cachedaemon.errors import CheckpointError, QuantizationError, ShardingError
from cachedaemon.loader import LoadOptions, load_state_dict
from cachedaemon.quant import fp8_block_dequantize
from cachedaemon.sharding import shard_dim


def raw_checkpoint(path: Path, header: dict[str, object], data: bytes) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    blob = json.dumps(header).encode()
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    return path


def entry(dtype: str, shape: list[int], begin: int, end: int) -> dict[str, object]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


@pytest.mark.parametrize(
    ("header", "data", "match"),
    [
        ({"a": entry("F32", [4], 0, 16), "b": entry("F32", [4], 8, 24)}, b"\0" * 24, "overlap"),
        ({"a": entry("F32", [8], 0, 32)}, b"\0" * 16, "truncated or its header is corrupt"),
        ({"a": entry("C64", [2], 0, 16)}, b"\0" * 16, "unsupported dtype 'C64'"),
        ({"a": entry("F32", [3], 0, 16)}, b"\0" * 16, "needs 12"),
        ({"a": {"dtype": "F32"}}, b"", "malformed header entry"),
    ],
)
def test_bad_headers_name_the_file_and_tensor(
    tmp_path: Path, header: dict[str, object], data: bytes, match: str
) -> None:
    model = raw_checkpoint(tmp_path / "m", header, data)
    with pytest.raises(CheckpointError, match=match):
        CheckpointReader(model)


def test_truncated_file(tiny_model: Path, tmp_path: Path) -> None:
    model = tmp_path / "m"
    shutil.copytree(tiny_model, model)
    st = model / "model.safetensors"
    st.write_bytes(st.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="runs past the file|truncated"):
        CheckpointReader(model)
    st.write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="no safetensors header"):
        CheckpointReader(model)


def test_missing_files(tmp_path: Path, tiny_model: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        CheckpointReader(tmp_path / "nope")
    model = tmp_path / "m"
    shutil.copytree(tiny_model, model)
    (model / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        CheckpointReader(model)
    (model / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "model-00001-of-00002.safetensors"}})
    )
    with pytest.raises(CheckpointError, match="missing"):
        CheckpointReader(model)
    (model / "config.json").unlink()
    with pytest.raises(CheckpointError, match="needs config.json"):
        CheckpointReader(model)


def test_sharded_checkpoint_reads_like_a_single_file(tiny_model: Path, tmp_path: Path) -> None:
    full = load_file(tiny_model / "model.safetensors")
    model = tmp_path / "sharded"
    model.mkdir()
    shutil.copy(tiny_model / "config.json", model)
    names = sorted(full)
    halves = {
        "model-00001-of-00002.safetensors": names[:7],
        "model-00002-of-00002.safetensors": names[7:],
    }
    weight_map = {}
    for fname, part in halves.items():
        save_file({n: full[n] for n in part}, str(model / fname))
        weight_map.update(dict.fromkeys(part, fname))
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    loaded = load_state_dict(model)
    assert loaded.keys() == full.keys()
    assert all(torch.equal(loaded[n], full[n]) for n in full)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_dtype_conversion(tiny_model: Path, dtype: str) -> None:
    full = load_file(tiny_model / "model.safetensors")
    loaded = load_state_dict(tiny_model, LoadOptions(dtype=dtype))
    for name, t in full.items():
        assert loaded[name].dtype == getattr(torch, dtype)
        assert torch.equal(loaded[name], t.to(getattr(torch, dtype)))


def test_tp2_shards_reassemble_into_the_full_tensors(tiny_model: Path) -> None:
    full = load_file(tiny_model / "model.safetensors")
    ranks = [load_state_dict(tiny_model, LoadOptions(tp_size=2, tp_rank=r)) for r in range(2)]
    split = 0
    for name, t in full.items():
        dim = shard_dim(name)
        if dim is None:
            assert torch.equal(ranks[0][name], t) and torch.equal(ranks[1][name], t)
        else:
            split += 1
            assert ranks[0][name].shape[dim] == t.shape[dim] // 2
            assert torch.equal(torch.cat([ranks[0][name], ranks[1][name]], dim), t)
    assert split == 2 + 7 * 2  # embed, lm_head, 7 projections per layer


def test_indivisible_dim_names_the_tensor(tiny_model: Path) -> None:
    with pytest.raises(
        ShardingError,
        match=r"tensor '[a-z_.0-9]+': dim 0 of size \d+ is not divisible by --tp-size 3",
    ):
        load_state_dict(tiny_model, LoadOptions(tp_size=3, tp_rank=0))


def test_unknown_quantization_names_the_allowed_ones(tiny_model: Path) -> None:
    with pytest.raises(QuantizationError, match="allowed: none, fp8-block"):
        load_state_dict(tiny_model, LoadOptions(quantization="gptq"))


def test_fp8_block_dequantizes_within_fp8_rounding(tiny_model: Path) -> None:
    full = load_file(tiny_model / "model.safetensors")
    q = load_state_dict(tiny_model, LoadOptions(quantization="fp8-block"))
    name = "model.layers.0.mlp.down_proj.weight"  # 64 x 128: partial blocks on one side
    assert q[name].dtype == torch.float8_e4m3fn
    assert q[name + "_scale_inv"].shape == (1, 1)
    src = full[name].float()
    deq = fp8_block_dequantize(q[name], q[name + "_scale_inv"])
    # e4m3 keeps 3 mantissa bits: relative error at most 2^-4 of the value, plus the
    # absolute floor of the smallest subnormal step times the block's scale
    tol = src.abs() * 2**-4 + q[name + "_scale_inv"].max() * 2**-9
    assert torch.all((deq - src).abs() <= tol)
    assert "model.norm.weight_scale_inv" not in q and q["model.norm.weight"].dtype == torch.bfloat16
