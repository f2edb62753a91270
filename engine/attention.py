"""Attention over the paged KV cache, for one step's batch.

- `Batch` is what one model step needs besides the token ids: positions, the cache slot of
  every token, and for a decode step each request's block table and context length.
- Prefill: a request's prompt attends only to itself (causal SDPA per request); its keys and
  values are written to its slots on the way.
- Decode: one query per request against its cached keys. On CUDA a Triton kernel reads the
  blocks in place (no gather, no host sync, so the step can be captured in a CUDA graph);
  elsewhere each request's blocks are gathered and fed to SDPA. Both compute the same
  function; the GPU test compares them.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from engine.paged_decode import paged_decode, triton_ready


@dataclasses.dataclass(frozen=True, slots=True)
class Batch:
    """One step's inputs besides ids. Prefill: `bounds` are the prompts' offsets in the
    flat token axis (host ints). Decode: one token per request, with `tables` (requests,
    max blocks) int32 and `lengths` (requests,) int32 context lengths, token included."""

    prefill: bool
    positions: torch.Tensor
    slots: torch.Tensor
    last: torch.Tensor  # index of each request's last token in the flat axis
    bounds: tuple[int, ...] = ()
    tables: torch.Tensor | None = None
    lengths: torch.Tensor | None = None
    kernel: bool = False  # decode with the Triton kernel (CUDA)


def store(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """Write x (tokens, kv_heads, head_dim) into one layer's cache at `slots`."""
    flat = cache.view(-1, cache.shape[-2], cache.shape[-1])
    flat.index_copy_(0, slots, x)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: Batch,
) -> torch.Tensor:
    """q (tokens, heads, dim), k/v (tokens, kv_heads, dim) -> (tokens, heads, dim)."""
    store(k_cache, batch.slots, k)
    store(v_cache, batch.slots, v)
    if batch.prefill:
        return _prefill(q, k, v, batch.bounds)
    assert batch.tables is not None and batch.lengths is not None
    if batch.kernel:
        return paged_decode(q, k_cache, v_cache, batch.tables, batch.lengths)
    return _decode_gather(q, k_cache, v_cache, batch.tables, batch.lengths)


def _prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: tuple[int, ...]
) -> torch.Tensor:
    out = torch.empty_like(q)
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        out[a:b] = _sdpa(q[a:b], k[a:b], v[a:b], causal=True)
    return out


def _decode_gather(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
) -> torch.Tensor:
    out = torch.empty_like(q)
    block = k_cache.shape[1]
    for i, n in enumerate(lengths.tolist()):
        blocks = tables[i, : -(-n // block)].long()
        k = k_cache[blocks].flatten(0, 1)[:n]
        v = v_cache[blocks].flatten(0, 1)[:n]
        out[i : i + 1] = _sdpa(q[i : i + 1], k, v, causal=False)
    return out


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool) -> torch.Tensor:
    """(n, heads, dim) x (m, kv_heads, dim): grouped-query attention, heads first inside."""
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=causal, enable_gqa=True
    )
    return o.transpose(0, 1)


def use_kernel(device: torch.device) -> bool:
    return device.type == "cuda" and triton_ready()
