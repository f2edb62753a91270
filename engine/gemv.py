# mypy: disable-error-code="no-untyped-def,untyped-decorator,misc,unused-ignore"
"""A matrix-vector product for one-row decode steps on CUDA (Triton): y = x @ w.T.

A decode step of one request reads every weight once to make one row of each projection;
it is bound by how fast the weights stream from device memory. Each program here reads
`block_n` whole rows of `w`, `block_k` columns at a time, keeps a float32 product per
element and sums it once at the end: one rounding to the compute dtype, as cuBLAS does.
`linear` takes it only where it is enabled and the shapes fit; anything else is
`F.linear`.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F


class Tiling(NamedTuple):
    block_n: int
    block_k: int
    warps: int
    stages: int


def tiling(n: int, k: int) -> Tiling:
    """The tiling for an (n, k) weight. On an H100 (bench/decode_profile.py) 1024-column
    steps beat 512 and 256 at every llama-8b shape, 8 rows a program beat 4 and 16 up to
    a few thousand rows, 16 rows the larger ones (gate|up, the head); with 4 warps and 3
    stages each beat cuBLAS's one-row product, by 1-12%."""
    block_k = next(b for b in (1024, 512, 256) if k % b == 0)
    return Tiling(16 if n >= 16384 else 8, block_k, 4, 3)


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def gemv(x_ptr, w_ptr, y_ptr, n, k, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        live = rows < n
        cols = tl.arange(0, BLOCK_K)
        w_at = w_ptr + rows.to(tl.int64)[:, None] * k + cols[None, :]
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for start in range(0, k, BLOCK_K):
            x = tl.load(x_ptr + start + cols).to(tl.float32)
            w = tl.load(w_at + start, mask=live[:, None], other=0.0)
            acc += w.to(tl.float32) * x[None, :]
        y = tl.sum(acc, axis=1)
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=live)

    return gemv


def fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """One contiguous row against a contiguous weight of its dtype, k a multiple of 256."""
    return (
        x.is_cuda
        and x.dim() == 2
        and x.shape[0] == 1
        and x.is_contiguous()
        and w.is_contiguous()
        and w.dtype == x.dtype
        and w.shape[1] % 256 == 0
    )


def gemv(x: torch.Tensor, w: torch.Tensor, t: Tiling | None = None) -> torch.Tensor:
    """(1, k) @ (n, k).T -> (1, n), on the Triton kernel."""
    n, k = w.shape
    t = t or tiling(n, k)
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    grid = (-(-n // t.block_n),)
    _kernel()[grid](
        x, w, y, n, k, BLOCK_N=t.block_n, BLOCK_K=t.block_k, num_warps=t.warps, num_stages=t.stages
    )
    return y


# Whether one-row products take the kernel (engine/model.py's projections and head).
enabled = False  # (engine/build.py sets it from --matvec)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, on the one-row kernel where it is enabled and the shapes fit."""
    if enabled and bias is None and fits(x, w):
        return gemv(x, w)
    return F.linear(x, w, bias)
