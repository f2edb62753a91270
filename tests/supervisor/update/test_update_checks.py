"""The refusals of `supervisor update` made from config.json and the safetensors headers
(supervisor/update/checks.py): each names the key or tensor that differs and what to do;
a checkpoint of the same architecture and shapes, other weights, passes."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

from supervisor.update.checks import checkpoint_refusals

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4}


def checkpoint(out: Path, shapes: dict[str, list[int]], fill: int = 0, **config: Any) -> Path:
    """A checkpoint dir: config.json, and one float32 safetensors file of `shapes`."""
    out.mkdir()
    (out / "config.json").write_text(json.dumps({**CONFIG, **config}))
    header: dict[str, Any] = {}
    start = 0
    for name, shape in shapes.items():
        size = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [start, start + size]}
        start += size
    head = json.dumps(header).encode()
    (out / "model.safetensors").write_bytes(
        struct.pack("<Q", len(head)) + head + bytes([fill]) * start
    )
    return out


SHAPES = {"embed.weight": [8, 4], "norm.weight": [4]}


def test_a_checkpoint_of_the_same_shapes_and_other_weights_passes(tmp_path: Path) -> None:
    old = checkpoint(tmp_path / "old", SHAPES)
    assert checkpoint_refusals(old, checkpoint(tmp_path / "new", SHAPES, fill=7)) == []


def test_another_architecture_is_refused_naming_the_key(tmp_path: Path) -> None:
    old = checkpoint(tmp_path / "old", SHAPES)
    new = checkpoint(tmp_path / "new", SHAPES, model_type="mistral")
    [why] = checkpoint_refusals(old, new)
    assert "model_type 'mistral', the running model 'llama'" in why
    assert "start a supervisor with the other model" in why


def test_other_shapes_are_refused_naming_each_key_and_tensor(tmp_path: Path) -> None:
    old = checkpoint(tmp_path / "old", SHAPES)
    shapes = {"embed.weight": [9, 4], "extra.weight": [2]}
    [why] = checkpoint_refusals(old, checkpoint(tmp_path / "new", shapes, hidden_size=5))
    assert "hidden_size 5 (running: 4)" in why
    assert "tensor norm.weight missing" in why
    assert "tensor extra.weight not in the running model" in why
    assert "tensor embed.weight [9, 4] (running: [8, 4])" in why


def test_a_dir_that_is_no_checkpoint_is_refused_naming_the_flag(tmp_path: Path) -> None:
    old = checkpoint(tmp_path / "old", SHAPES)
    assert "--model: " in checkpoint_refusals(old, tmp_path / "nowhere")[0]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{}")
    (bad / "model.safetensors").write_bytes(b"\x01")
    [why] = checkpoint_refusals(old, bad)
    assert why.startswith(f"--model: {bad} is not a readable checkpoint")
