"""A checksum of a tensor's bytes computed where the bytes live, in one pass on the GPU.

Algorithm `int8mm-v1`: the bytes, read as int8 rows of 4096, are multiplied by a fixed
4096x16 int8 matrix (an exact int8 GEMM with int32 accumulation: at most
4096*128*128 < 2**31); each row's 16 values are weighted by a per-row factor and summed
in int64 (exact modulo 2**64, so the result does not depend on reduction order); the
last partial row is summed with per-byte weights. The host folds the byte count and those
integers with BLAKE2b. A GEMM with 16 output columns reads each byte once on the matrix
units, so the pass runs near memory bandwidth.

Changing anything here changes every checksum: bump the version in ALGO.
"""

from __future__ import annotations

import hashlib
import struct

import torch

ALGO = "int8mm-v1"
ROW = 4096  # bytes per GEMM row
COLS = 16  # output columns of the projection
_MIN_ROWS = 17  # torch._int_mm needs more than 16 rows
_projections: dict[torch.device, torch.Tensor] = {}


def _projection(device: torch.device) -> torch.Tensor:
    """The fixed ROW x COLS int8 matrix, from integer arithmetic alone (no RNG)."""
    proj = _projections.get(device)
    if proj is None:
        i = torch.arange(ROW * COLS, dtype=torch.int64)
        mixed = ((i + 1) * 2654435761) % (1 << 32)
        mixed = (mixed ^ (mixed >> 13)) * 40503 % (1 << 32)
        proj = ((mixed >> 8) % 256 - 128).to(torch.int8).reshape(ROW, COLS).to(device)
        _projections[device] = proj
    return proj


def _weights(count: int, device: torch.device, mult: int) -> torch.Tensor:
    """Position weights in [1, 2**31): distinct per position, exact in int64 products."""
    i = torch.arange(count, dtype=torch.int64, device=device)
    return (i * mult + 12345) % 2147483629 + 1


def _terms(data: torch.Tensor) -> torch.Tensor:
    """COLS + 2 int64 values on data's device; no host sync."""
    flat = data.reshape(-1)
    if flat.dtype != torch.uint8:
        raise TypeError(f"checksum takes a flat uint8 tensor, got {flat.dtype}")
    rows = flat.numel() // ROW
    if rows < _MIN_ROWS:
        rows = 0
    out = torch.zeros(COLS + 2, dtype=torch.int64, device=flat.device)
    if rows:
        a = flat[: rows * ROW].view(torch.int8).view(rows, ROW)
        if a.data_ptr() % 16:
            a = a.clone()  # the int8 GEMM wants 16-byte aligned rows
        proj = torch._int_mm(a, _projection(flat.device))
        w = _weights(rows, flat.device, 2654435761)
        out[:COLS] = (proj.to(torch.int64) * w[:, None]).sum(dim=0)
    tail = flat[rows * ROW :].to(torch.int64)
    if tail.numel():
        out[COLS] = (tail * _weights(tail.numel(), flat.device, 40503)).sum()
        out[COLS + 1] = (tail * _weights(tail.numel(), flat.device, 97)).sum()
    return out


def _fold(nbytes: int, values: list[int]) -> str:
    packed = struct.pack(f"<q{len(values)}q", nbytes, *values)
    return hashlib.blake2b(packed, digest_size=16).hexdigest()


def gpu_checksums(tensors: list[torch.Tensor]) -> list[str]:
    """Checksums of many flat uint8 tensors with a single device-to-host sync."""
    if not tensors:
        return []
    terms = torch.stack([_terms(t) for t in tensors]).cpu().tolist()
    return [_fold(t.numel(), v) for t, v in zip(tensors, terms, strict=True)]


def gpu_checksum(data: torch.Tensor) -> str:
    return gpu_checksums([data])[0]
