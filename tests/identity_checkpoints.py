"""Checkpoints that look alike: a copy, and a copy with one tensor's values changed but
its header (names, dtypes, shapes, offsets) byte for byte the same."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from cachedaemon.checkpoint import read_header
from cachedaemon.loader import dtype_of

TENSOR = "model.layers.0.mlp.down_proj.weight"


def copy_of(model: Path, dest: Path) -> Path:
    """A byte-identical copy at another path (new inodes, new mtimes)."""
    shutil.copytree(model, dest)
    return dest


def scale_in_place(model: Path, name: str = TENSOR, factor: float = 1.5) -> torch.Tensor:
    """Multiply one tensor of model.safetensors by `factor`, writing over its bytes in the
    same file (same size, same header); returns the new values."""
    path = model / "model.safetensors"
    info = next(i for i in read_header(path) if i.name == name)
    with path.open("r+b") as f:
        f.seek(info.start)
        raw = bytearray(f.read(info.nbytes))
        values = torch.frombuffer(raw, dtype=dtype_of(info.dtype)).view(info.shape)
        scaled = (values.float() * factor).to(values.dtype)
        f.seek(info.start)
        f.write(scaled.contiguous().view(torch.uint8).numpy().tobytes())
    return scaled


def changed_copy(model: Path, dest: Path) -> tuple[Path, torch.Tensor]:
    """A copy whose TENSOR is 1.5 times the original's; same header, same sizes."""
    copy_of(model, dest)
    return dest, scale_in_place(dest)
