# mypy: disable-error-code="no-untyped-def,untyped-decorator,misc,unused-ignore"
"""Decode attention read straight from the paged KV cache: a Triton kernel for CUDA.

One program per (request, kv head): it walks the request's block table, computes the scores
of the query heads that share this kv head, and keeps a running softmax (max, sum) so the
keys are read once. No gather and no host sync: a decode step that uses it can be captured
in a CUDA graph. Triton is imported lazily; without it (CPU builds of torch) the engine uses
the gather path in `engine.attention`.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import torch


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

    @triton.jit
    def kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, lengths_ptr,
        scale, group, head_dim, table_stride,
        q_s0, q_s1, k_s0, k_s1, k_s2, o_s0, o_s1,
        BLOCK: tl.constexpr, GROUP: tl.constexpr, DIM: tl.constexpr, WIDTH: tl.constexpr,
    ):  # fmt: skip
        seq = tl.program_id(0)
        kvh = tl.program_id(1)
        heads = kvh * group + tl.arange(0, GROUP)
        hmask = tl.arange(0, GROUP) < group
        dims = tl.arange(0, DIM)
        dmask = dims < head_dim
        qm = hmask[:, None] & dmask[None, :]
        q = tl.load(q_ptr + seq * q_s0 + heads[:, None] * q_s1 + dims[None, :], mask=qm, other=0.0)
        q = q.to(tl.float32) * scale
        n = tl.load(lengths_ptr + seq)
        m = tl.full([GROUP], float("-inf"), tl.float32)
        total = tl.zeros([GROUP], tl.float32)
        acc = tl.zeros([GROUP, DIM], tl.float32)
        toks = tl.arange(0, BLOCK)
        # WIDTH > 0 walks that many table entries, masked (Triton's CPU interpreter cannot
        # loop to a loaded bound); compiled (WIDTH 0), the loop stops at the last block.
        for j in range(0, WIDTH if WIDTH > 0 else tl.cdiv(n, BLOCK)):
            blk = tl.load(tables_ptr + seq * table_stride + j).to(tl.int64)
            valid = j * BLOCK + toks < n
            kv_off = blk * k_s0 + toks[:, None] * k_s1 + kvh * k_s2 + dims[None, :]
            kvm = valid[:, None] & dmask[None, :]
            k = tl.load(k_ptr + kv_off, mask=kvm, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + kv_off, mask=kvm, other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            total = total * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
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
    q = q.contiguous()
    out = torch.empty_like(q)
    _kernel()[(n, kv_heads)](
        q, k_cache, v_cache, out, tables, lengths,
        1.0 / math.sqrt(dim), group, dim, tables.stride(0),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1),
        BLOCK=block, GROUP=triton.next_power_of_2(group), DIM=triton.next_power_of_2(dim),
        WIDTH=tables.shape[1] if os.environ.get("TRITON_INTERPRET") == "1" else 0,
    )  # fmt: skip
    return out
