# mypy: disable-error-code="no-untyped-def,untyped-decorator,misc,unused-ignore"
"""A step's sampling: each row's greedy token, its logprob and the top K, in one tensor.

`sample` is the eager math (torch): log-softmax, argmax, top-k, gather and a cat, about
thirty kernels on CUDA, which read the float32 logits several times over (0.13 ms of a
one-request decode step on an H100, 0.46 ms at 128 requests:
bench/results/h100_decode/NOTES.md). `sample_kernel` does the same in two Triton kernels
that read the logits once, in the head's own dtype:
- each row's vocabulary is cut in CHUNK-wide pieces, one program each: its max, the sum of
  exp(x - max), and its K largest (value, first index);
- one program a row merges them: the log of the row's softmax denominator, and the K
  largest of its pieces' candidates, ties to the lowest index (as argmax).
The greedy token is the top-1, so it is the argmax of the logits, ties included.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

CHUNK = 2048  # vocabulary entries a program of the first kernel reads
NO_INDEX = 2**31 - 1  # an index past any vocabulary: what a masked candidate carries


def sample(logits: torch.Tensor, k: int) -> torch.Tensor:
    """(n, vocab) -> (n, 2 + 2k) float32: greedy id, its logprob, top-k ids, top-k logprobs.
    One tensor, so reading the step's result is one device-to-host copy."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.argmax(logits, dim=-1, keepdim=True)
    vals, top = torch.topk(logp, min(k, logp.shape[-1]), dim=-1)
    return torch.cat([ids.float(), logp.gather(-1, ids), top.float(), vals], dim=-1)


@functools.cache
def _kernels() -> dict[str, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def pieces(
        x_ptr, m_ptr, s_ptr, tv_ptr, ti_ptr, vocab, x_row, chunks,
        K: tl.constexpr, KP: tl.constexpr, CHUNK: tl.constexpr, NO_INDEX: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        idx = c * CHUNK + tl.arange(0, CHUNK)
        live = idx < vocab
        x = tl.load(x_ptr + row * x_row + idx, mask=live, other=float("-inf")).to(tl.float32)
        m = tl.max(x, axis=0)
        s = tl.sum(tl.where(live, tl.exp(x - m), 0.0), axis=0)
        at = row * chunks + c
        tl.store(m_ptr + at, m)
        tl.store(s_ptr + at, s)
        ks = tl.arange(0, KP)
        vals = tl.full([KP], float("-inf"), tl.float32)
        ids = tl.full([KP], NO_INDEX, tl.int32)
        for j in tl.static_range(K):
            v = tl.max(x, axis=0)
            i = tl.min(tl.where(live & (x == v), idx, NO_INDEX), axis=0)
            vals = tl.where(ks == j, v, vals)
            ids = tl.where(ks == j, i, ids)
            x = tl.where(idx == i, float("-inf"), x)
            live = live & (idx != i)
        tl.store(tv_ptr + at * KP + ks, vals)
        tl.store(ti_ptr + at * KP + ks, ids)

    @triton.jit
    def merge(
        m_ptr, s_ptr, tv_ptr, ti_ptr, out_ptr, chunks,
        K: tl.constexpr, KP: tl.constexpr, CHUNKS: tl.constexpr, NO_INDEX: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        cs = tl.arange(0, CHUNKS)
        cm = cs < chunks
        m = tl.load(m_ptr + row * chunks + cs, mask=cm, other=float("-inf"))
        s = tl.load(s_ptr + row * chunks + cs, mask=cm, other=0.0)
        top = tl.max(m, axis=0)
        lse = top + tl.log(tl.sum(tl.where(cm, s * tl.exp(m - top), 0.0), axis=0))
        cand = tl.arange(0, CHUNKS * KP)
        live = (cand // KP) < chunks
        v = tl.load(tv_ptr + row * chunks * KP + cand, mask=live, other=float("-inf"))
        i = tl.load(ti_ptr + row * chunks * KP + cand, mask=live, other=NO_INDEX)
        live = live & (i != NO_INDEX)
        out = out_ptr + row * (2 + 2 * K)
        for j in tl.static_range(K):
            best = tl.max(v, axis=0)
            at = tl.min(tl.where(live & (v == best), i, NO_INDEX), axis=0)
            if j == 0:
                tl.store(out, at.to(tl.float32))
                tl.store(out + 1, best - lse)
            tl.store(out + 2 + j, at.to(tl.float32))
            tl.store(out + 2 + K + j, best - lse)
            hit = live & (i == at)
            v = tl.where(hit, float("-inf"), v)
            live = live & (i != at)

    return {"pieces": pieces, "merge": merge}


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def sample_kernel(logits: torch.Tensor, k: int) -> torch.Tensor:
    """`sample`'s result from the Triton kernels; logits (n, vocab) in any float dtype,
    each row dense. The logprobs agree with `sample`'s to float32 rounding."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    n, vocab = logits.shape
    k = min(k, vocab)
    chunks = -(-vocab // CHUNK)
    kp = max(2, _pow2(k))
    f32, at = torch.float32, logits.device
    m = torch.empty((n, chunks), dtype=f32, device=at)
    s = torch.empty((n, chunks), dtype=f32, device=at)
    tv = torch.empty((n, chunks, kp), dtype=f32, device=at)
    ti = torch.empty((n, chunks, kp), dtype=torch.int32, device=at)
    out = torch.empty((n, 2 + 2 * k), dtype=f32, device=at)
    ks = _kernels()
    ks["pieces"][(n, chunks)](
        logits, m, s, tv, ti, vocab, logits.stride(0), chunks,
        K=k, KP=kp, CHUNK=CHUNK, NO_INDEX=NO_INDEX,
    )  # fmt: skip
    ks["merge"][(n,)](
        m, s, tv, ti, out, chunks, K=k, KP=kp, CHUNKS=max(2, _pow2(chunks)), NO_INDEX=NO_INDEX
    )
    return out
