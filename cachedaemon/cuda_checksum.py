"""Checksums of tensors' bytes computed where the bytes live: a few kernels per pool chunk,
however many tensors it holds, and one device-to-host copy for all of them.

Algorithm `int8mm-v3`, for one tensor of n bytes:
- its full 256-byte rows, read as int8, are multiplied by a fixed 256x8 int8 matrix: an
  exact int8 GEMM with int32 accumulation (|value| <= 256*128*128 < 2**31); each row's 8
  values are mixed into one int64 v[j] with fixed odd multipliers;
- S1 = sum_j v[j] and S2 = sum_j (j + 1) * v[j], in int64 (exact modulo 2**64, so the
  reduction order does not matter);
- the n % 256 trailing bytes b[k] give T1 = sum (k + 1) * b[k], T2 = sum (k + 1)**2 * b[k];
- the host folds n, S1, S2, T1, T2 with BLAKE2b.
Tensors of one pool chunk start at 256-byte aligned offsets, so the chunk is projected in
one GEMM and every tensor's S1/S2 come from 1-D prefix sums at its first and last row:
S2 = (A[e] - A[s]) - s * (B[e] - B[s]) with A, B the prefix sums of (i + 1) * v[i] and v[i].

Changing anything here changes every checksum: bump the version in ALGO.
"""

from __future__ import annotations

import bisect
import hashlib
import struct
from collections.abc import Sequence

import torch

ALGO = "int8mm-v3"
ROW = 256  # bytes per GEMM row; pool tensors start at multiples of it
COLS = 8
SLICE_ROWS = 1 << 22  # rows projected per GEMM: 1 GiB of input, bounded scratch
_MIN_GEMM_ROWS = 17  # torch._int_mm needs more than 16 rows
_MIX = (
    0x9E3779B1,
    0x85EBCA77,
    0xC2B2AE3D,
    0x27D4EB2F,
    0x165667B1,
    0xD3A2646D,
    0xFD7046C5,
    0xB55A4F09,
)
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


def _row_values(rows: torch.Tensor) -> torch.Tensor:
    """(r, ROW) int8 -> (r,) int64: the exact projection, columns mixed into one value."""
    proj = _projection(rows.device)
    if rows.shape[0] >= _MIN_GEMM_ROWS:
        if rows.data_ptr() % 16:
            rows = rows.clone()  # the int8 GEMM wants 16-byte aligned rows
        p = torch._int_mm(rows, proj).to(torch.int64)
    else:
        p = (rows.to(torch.int64).unsqueeze(2) * proj.to(torch.int64).unsqueeze(0)).sum(1)
    mix = torch.tensor(_MIX, dtype=torch.int64, device=rows.device)
    return (p * mix).sum(1)


def _prefix_at(span: torch.Tensor, points: list[int]) -> torch.Tensor:
    """B[k] and A[k] (prefix sums over rows < k) at each sorted row index k: (len, 2)."""
    dev = span.device
    out = torch.zeros(len(points), 2, dtype=torch.int64, device=dev)
    carry = torch.zeros(2, 1, dtype=torch.int64, device=dev)
    total = points[-1] if points else 0
    for lo in range(0, total, SLICE_ROWS):
        hi = min(lo + SLICE_ROWS, total)
        v = _row_values(span[lo * ROW : hi * ROW].view(torch.int8).view(hi - lo, ROW))
        idx = torch.arange(lo + 1, hi + 1, dtype=torch.int64, device=dev)
        acc = torch.stack([v, v * idx]).cumsum(1) + carry  # scans along the inner dim
        first, last = bisect.bisect_right(points, lo), bisect.bisect_right(points, hi)
        if last > first:
            at = torch.tensor(points[first:last], dtype=torch.int64) - lo - 1
            out[first:last] = acc[:, at.to(dev)].t()
        carry = acc[:, -1:]
    return out


def _span_terms(span: torch.Tensor, starts: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    """(len(starts), 4) int64 terms of the byte ranges [start, start+size) of span;
    every start is a multiple of ROW."""
    dev = span.device
    first = [s // ROW for s in starts]
    last = [s // ROW + n // ROW for s, n in zip(starts, sizes, strict=True)]
    points = sorted(set(first) | set(last))
    pref = _prefix_at(span, points)
    where = {k: i for i, k in enumerate(points)}
    s_idx = torch.tensor([where[k] for k in first], device=dev)
    e_idx = torch.tensor([where[k] for k in last], device=dev)
    diff = pref[e_idx] - pref[s_idx]
    b, a = diff[:, :1], diff[:, 1:]
    s_rows = torch.tensor(first, dtype=torch.int64, device=dev)[:, None]
    return torch.cat([b, a - s_rows * b, _tail_terms(span, starts, sizes)], dim=1)


def _tail_terms(span: torch.Tensor, starts: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    """T1, T2 of each range's trailing n % ROW bytes: (len(starts), 2) int64."""
    dev = span.device
    out = torch.zeros(len(starts), 2, dtype=torch.int64, device=dev)
    size = torch.tensor(sizes, dtype=torch.int64)
    tails = size % ROW
    total = int(tails.sum())
    if not total:
        return out
    seg = torch.repeat_interleave(torch.arange(len(starts)), tails)
    first = torch.cumsum(tails, 0) - tails  # where each range's tail begins in the gather
    k = torch.arange(total) - first[seg] + 1  # 1-based position inside the tail
    pos = (torch.tensor(starts, dtype=torch.int64) + size - tails)[seg] + k - 1
    byte = span[pos.to(dev)].to(torch.int64)
    kk = k.to(dev)
    terms = torch.stack([byte * kk, byte * kk * kk], dim=1)
    return out.index_add_(0, seg.to(dev), terms)


def _fold(nbytes: int, values: list[int]) -> str:
    packed = struct.pack(f"<q{len(values)}q", nbytes, *values)
    return hashlib.blake2b(packed, digest_size=16).hexdigest()


def _groups(tensors: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, list[int], list[int]]]:
    """(span, starts, members) per storage whose members all start ROW-aligned from its
    lowest offset; any other tensor is a span of its own."""
    by_storage: dict[tuple[str, int], list[int]] = {}
    for i, t in enumerate(tensors):
        by_storage.setdefault((str(t.device), t.untyped_storage().data_ptr()), []).append(i)
    out = []
    for (_, base_ptr), members in by_storage.items():
        offs = [tensors[i].data_ptr() - base_ptr for i in members]
        low = min(offs)
        if len(members) > 1 and all((o - low) % ROW == 0 for o in offs):
            end = max(o + tensors[i].numel() for o, i in zip(offs, members, strict=True))
            span = tensors[members[0]].as_strided((end - low,), (1,), low)
            out.append((span, [o - low for o in offs], members))
        else:
            out += [(tensors[i], [0], [i]) for i in members]
    return out


def gpu_checksums(tensors: Sequence[torch.Tensor]) -> list[str]:
    """Checksums of flat uint8 tensors (pool regions), with one device-to-host copy."""
    for t in tensors:
        if t.dtype != torch.uint8 or t.dim() != 1 or t.stride(0) != 1:
            raise TypeError(
                f"checksum takes flat contiguous uint8 tensors, got {t.dtype} {t.shape}"
            )
    if not tensors:
        return []
    rows: list[list[int]] = [[] for _ in tensors]
    parts, order = [], []
    for span, starts, members in _groups(tensors):
        parts.append(_span_terms(span, starts, [tensors[i].numel() for i in members]))
        order += members
    values = torch.cat(parts).cpu().tolist()
    for i, v in zip(order, values, strict=True):
        rows[i] = v
    return [_fold(t.numel(), rows[i]) for i, t in enumerate(tensors)]


def gpu_checksum(data: torch.Tensor) -> str:
    return gpu_checksums([data.reshape(-1)])[0]
