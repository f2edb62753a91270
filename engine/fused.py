# mypy: disable-error-code="no-untyped-def,untyped-decorator,misc,unused-ignore"
"""Fused elementwise kernels for CUDA steps (Triton): fewer, larger kernels per layer.

A decode step of an 8B model is about 3 ms of weight reads; each of the ~40 small kernels
a layer launches eagerly costs ~2 us even inside a CUDA graph, ~2.5 ms over 32 layers. These
three fuse what the eager path does in several kernels, with the same math in float32 and
one rounding to the compute dtype at the end:
- `add_rms_norm`: residual add (optional) + RMSNorm (HF numerics: normalise in float32,
  round, multiply by the weight);
- `rotary`: q and k rotated in place; `rope_store`: that and the keys and values written to
  the cache, in one kernel;
- `silu_mul`: silu(gate) * up.
Each has a torch twin (used on CPU and when a step asks for no kernels) with the eager math.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F


def rms_norm_torch(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def rotate_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@functools.cache
def _kernels() -> dict[str, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def add_norm(
        x_ptr, d_ptr, w_ptr, out_ptr, res_ptr, dim, eps, ADD: tl.constexpr, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = cols < dim
        x = tl.load(x_ptr + row * dim + cols, mask=m, other=0.0)
        if ADD:
            d = tl.load(d_ptr + row * dim + cols, mask=m, other=0.0)
            x = (x.to(tl.float32) + d.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(res_ptr + row * dim + cols, x, mask=m)
        h = x.to(tl.float32)
        var = tl.sum(h * h, axis=0) / dim
        h = (h * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)
        w = tl.load(w_ptr + cols, mask=m, other=0.0)
        tl.store(
            out_ptr + row * dim + cols, (w.to(tl.float32) * h.to(tl.float32)).to(w.dtype), mask=m
        )

    @triton.jit
    def rope(x_ptr, cos_ptr, sin_ptr, heads, half, BLOCK: tl.constexpr, HEADS: tl.constexpr):
        tok = tl.program_id(0).to(tl.int64)
        hs = tl.arange(0, HEADS)
        cols = tl.arange(0, BLOCK)
        m = (hs[:, None] < heads) & (cols[None, :] < half)
        base = x_ptr + tok * heads * 2 * half + hs[:, None] * 2 * half + cols[None, :]
        a = tl.load(base, mask=m, other=0.0).to(tl.float32)
        b = tl.load(base + half, mask=m, other=0.0).to(tl.float32)
        cm = cols < half
        c1 = tl.load(cos_ptr + tok * 2 * half + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
        s1 = tl.load(sin_ptr + tok * 2 * half + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
        c2 = tl.load(cos_ptr + tok * 2 * half + half + cols, mask=cm, other=0.0).to(tl.float32)[
            None, :
        ]
        s2 = tl.load(sin_ptr + tok * 2 * half + half + cols, mask=cm, other=0.0).to(tl.float32)[
            None, :
        ]
        ty = x_ptr.dtype.element_ty
        tl.store(base, (a * c1 - b * s1).to(ty), mask=m)
        tl.store(base + half, (b * c2 + a * s2).to(ty), mask=m)

    @triton.jit
    def rope_store(
        q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, slots_ptr, pos_ptr,
        heads, kv_heads, half, q_row, k_row, v_row,
        BLOCK: tl.constexpr, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, TABLE: tl.constexpr,
    ):  # fmt: skip
        tok = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        cm = cols < half
        dim = 2 * half
        row = tl.load(pos_ptr + tok).to(tl.int64) if TABLE else tok  # cos/sin's row
        c1 = tl.load(cos_ptr + row * dim + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
        s1 = tl.load(sin_ptr + row * dim + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
        c2 = tl.load(cos_ptr + row * dim + half + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
        s2 = tl.load(sin_ptr + row * dim + half + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
        ty = q_ptr.dtype.element_ty
        hs = tl.arange(0, HEADS)
        m = (hs[:, None] < heads) & cm[None, :]
        base = q_ptr + tok * q_row + hs[:, None] * dim + cols[None, :]
        a = tl.load(base, mask=m, other=0.0).to(tl.float32)
        b = tl.load(base + half, mask=m, other=0.0).to(tl.float32)
        tl.store(base, (a * c1 - b * s1).to(ty), mask=m)
        tl.store(base + half, (b * c2 + a * s2).to(ty), mask=m)
        ks = tl.arange(0, KV_HEADS)
        km = (ks[:, None] < kv_heads) & cm[None, :]
        inner = ks[:, None] * dim + cols[None, :]
        slot = tl.load(slots_ptr + tok).to(tl.int64)
        kb = k_ptr + tok * k_row + inner
        a = tl.load(kb, mask=km, other=0.0).to(tl.float32)
        b = tl.load(kb + half, mask=km, other=0.0).to(tl.float32)
        ka, kb2 = (a * c1 - b * s1).to(ty), (b * c2 + a * s2).to(ty)
        tl.store(kb, ka, mask=km)
        tl.store(kb + half, kb2, mask=km)
        cache = slot * kv_heads * dim + inner
        tl.store(kc_ptr + cache, ka, mask=km)
        tl.store(kc_ptr + cache + half, kb2, mask=km)
        vb = v_ptr + tok * v_row + inner
        tl.store(vc_ptr + cache, tl.load(vb, mask=km, other=0.0), mask=km)
        tl.store(vc_ptr + cache + half, tl.load(vb + half, mask=km, other=0.0), mask=km)

    @triton.jit
    def silu_mul(g_ptr, u_ptr, out_ptr, width, g_row, u_row, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        i = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = i < width
        g = tl.load(g_ptr + row * g_row + i, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * u_row + i, mask=m, other=0.0).to(tl.float32)
        out = (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * width + i, out, mask=m)

    return {"add_norm": add_norm, "rope": rope, "rope_store": rope_store, "silu_mul": silu_mul}


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + delta), x + delta); with delta None, (norm(x), x). x: (tokens, dim)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    res = torch.empty_like(x) if delta is not None else x
    d = delta.contiguous() if delta is not None else x
    dim = x.shape[-1]
    _kernels()["add_norm"][(x.shape[0],)](
        x, d, w, out, res, dim, eps, ADD=delta is not None, BLOCK=_pow2(dim)
    )
    return out, res


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (tokens, heads, dim), contiguous, in place; cos/sin (tokens, 1, dim)."""
    n, heads, dim = x.shape
    half = dim // 2
    _kernels()["rope"][(n,)](
        x, cos.contiguous(), sin.contiguous(), heads, half, BLOCK=_pow2(half), HEADS=_pow2(heads)
    )
    return x


def rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor | None = None,
) -> None:
    """Rotate q and k (tokens, heads, dim) in place, and write k and v to the cache (one
    layer's (blocks, block, kv_heads, dim)) at each token's slot: one kernel, not four.
    Each token's heads lie together (a row of a fused q|k|v product is fine). cos, sin:
    each token's (tokens, 1, dim), or with `positions` (one a token) tables of
    (positions, dim) that each token's row is read from."""
    n, heads, dim = q.shape
    kv_heads = k.shape[1]
    v = v if _rows(v) else v.contiguous()
    if not (_rows(q) and _rows(k)):
        raise ValueError(
            "rope_store rotates q and k in place: each token's heads must lie together"
        )
    _kernels()["rope_store"][(n,)](
        q, k, v, cos.contiguous(), sin.contiguous(), k_cache, v_cache, slots,
        slots if positions is None else positions,
        heads, kv_heads, dim // 2, q.stride(0), k.stride(0), v.stride(0),
        BLOCK=_pow2(dim // 2), HEADS=_pow2(heads), KV_HEADS=_pow2(kv_heads),
        TABLE=positions is not None,
    )  # fmt: skip


def _rows(x: torch.Tensor) -> bool:
    """Whether x (tokens, heads, dim) keeps each token's heads together, densely."""
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g) * u for (tokens, width) g and u, each row dense (a row may be part of a
    wider one: the halves of a fused gate|up product)."""
    g = g if g.stride(-1) == 1 else g.contiguous()
    u = u if u.stride(-1) == 1 else u.contiguous()
    rows, width = g.shape
    out = torch.empty((rows, width), dtype=g.dtype, device=g.device)
    grid = (rows, -(-width // 1024))
    _kernels()["silu_mul"][grid](g, u, out, width, g.stride(0), u.stride(0), BLOCK=1024)
    return out


def silu_mul_torch(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return F.silu(g) * u
