# mypy: disable-error-code="no-untyped-def,untyped-decorator,misc,unused-ignore"
"""Decode attention read straight from the paged KV cache: a Triton kernel for CUDA.

One program per (request, kv head): it walks the request's tokens TILE at a time, looking
each up in its block table, scores them for the query heads that share this kv head (one
matrix product, the heads padded to 16 rows), and keeps a running softmax (max, sum) so the
keys are read once. bf16 probabilities meet bf16 values in the second product, as flash
attention does; float32 stays float32. No gather and no host sync: a decode step that uses it can be captured
in a CUDA graph. Triton is imported lazily; without it (CPU builds of torch) the engine uses
the gather path in `engine.attention`.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import torch

TILE = 64  # tokens scored per loop step


@functools.cache
def triton_ready() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    # the block table's width changes with every batch: one compiled kernel for all widths
    @triton.jit(do_not_specialize=["table_stride"])
    def kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, lengths_ptr,
        scale, group, head_dim, table_stride,
        q_s0, q_s1, k_s0, k_s1, k_s2, o_s0, o_s1,
        BLOCK: tl.constexpr, TILE: tl.constexpr, GROUP: tl.constexpr, DIM: tl.constexpr,
        WIDTH: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        seq = tl.program_id(0)
        kvh = tl.program_id(1)
        heads = kvh * group + tl.arange(0, GROUP)
        hmask = tl.arange(0, GROUP) < group
        dims = tl.arange(0, DIM)
        dmask = dims < head_dim
        qm = hmask[:, None] & dmask[None, :]
        q = tl.load(q_ptr + seq * q_s0 + heads[:, None] * q_s1 + dims[None, :], mask=qm, other=0.0)
        n = tl.load(lengths_ptr + seq)
        m = tl.full([GROUP], float("-inf"), tl.float32)
        total = tl.zeros([GROUP], tl.float32)
        acc = tl.zeros([GROUP, DIM], tl.float32)
        toks = tl.arange(0, TILE)
        # TILE tokens a step, each looked up in the block table. WIDTH > 0 walks that many
        # tiles, masked (Triton's CPU interpreter cannot loop to a loaded bound); compiled
        # (WIDTH 0), the loop stops at the request's last token.
        for j in range(0, WIDTH if WIDTH > 0 else tl.cdiv(n, TILE)):
            t = j * TILE + toks
            valid = t < n
            blk = tl.load(tables_ptr + seq * table_stride + t // BLOCK, mask=valid, other=0)
            off = blk.to(tl.int64) * k_s0 + (t % BLOCK) * k_s1 + kvh * k_s2
            kvm = valid[:, None] & dmask[None, :]
            k = tl.load(k_ptr + off[:, None] + dims[None, :], mask=kvm, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            total = total * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + off[:, None] + dims[None, :], mask=kvm, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
        out = acc / total[:, None]
        o_off = seq * o_s0 + heads[:, None] * o_s1 + dims[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=qm)

    return kernel


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
) -> torch.Tensor:
    """q (requests, heads, dim); caches (blocks, block, kv_heads, dim) -> (requests, heads, dim)."""
    import triton

    n, heads, dim = q.shape
    block, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    q = q if q.stride(2) == 1 else q.contiguous()  # (a row of a fused q|k|v product is fine)
    out = torch.empty((n, heads, dim), dtype=q.dtype, device=q.device)
    _kernel()[(n, kv_heads)](
        q, k_cache, v_cache, out, tables, lengths,
        1.0 / math.sqrt(dim), group, dim, tables.stride(0),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1),
        BLOCK=block, TILE=TILE, GROUP=max(16, triton.next_power_of_2(group)),
        DIM=max(16, triton.next_power_of_2(dim)),
        WIDTH=-(-tables.shape[1] * block // TILE) if os.environ.get("TRITON_INTERPRET") == "1" else 0,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    return out
