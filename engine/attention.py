"""Attention over the paged KV cache, for one step's batch.

- `Batch` is what one model step needs besides the token ids: positions, the cache slot of
  every token, and for a decode step each request's block table and context length.
- Prefill: a request's prompt attends only to itself (causal SDPA); its keys and values are
  written to its slots on the way. One step may prefill new prompts and decode running
  requests together (prompts first in the token axis).
- Decode: one query per request against its cached keys. On CUDA a Triton kernel reads the
  blocks in place (no gather, no host sync, so the step can be captured in a CUDA graph);
  elsewhere the requests' blocks are gathered into one padded batch for one masked SDPA
  call. Both compute the same function; the GPU test compares them.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.paged_decode import paged_decode, triton_ready


@dataclasses.dataclass(frozen=True, slots=True)
class Batch:
    """One step's inputs besides ids. The first `bounds[-1]` tokens are prompts being
    prefilled (`bounds`: each prompt's offset, host ints); the rest decode one token per
    request, with `tables` (requests, max blocks) and `lengths` (requests,), int64,
    context lengths, token included. `triton`: use the CUDA kernels (engine.fused,
    engine.paged_decode) for this step."""

    positions: torch.Tensor
    slots: torch.Tensor
    last: torch.Tensor  # index of each request's last token in the flat axis
    bounds: tuple[int, ...] = (0,)
    tables: torch.Tensor | None = None
    lengths: torch.Tensor | None = None
    triton: bool = False
    # rows of the decode part that continue a kept prefix, one (first, end, context) per
    # request, host ints: off CUDA each request's blocks are gathered once for all its rows
    extend: tuple[tuple[int, int, int], ...] = ()

    @property
    def prefill_tokens(self) -> int:
        return self.bounds[-1]


# Not cuDNN: it builds a plan for every new shape (0.1-0.7 s seen on an H200 for a new
# prompt length or batch), which a server with ever-changing batches pays again and again.
BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


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
    """q (tokens, heads, dim), k/v (tokens, kv_heads, dim) -> (tokens, heads, dim). With
    `batch.triton` the keys and values are already in the cache (`fused.rope_store`)."""
    if not batch.triton:
        store(k_cache, batch.slots, k)
        store(v_cache, batch.slots, v)
    split = batch.prefill_tokens
    if split == q.shape[0]:
        return _prefill(q, k, v, batch.bounds)
    assert batch.tables is not None and batch.lengths is not None
    if split == 0:
        return _decode(q, k_cache, v_cache, batch)
    out = torch.empty_like(q)
    out[:split] = _prefill(q[:split], k[:split], v[:split], batch.bounds)
    out[split:] = _decode(q[split:], k_cache, v_cache, batch)
    return out


def _decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: Batch
) -> torch.Tensor:
    """The decode part: one query a row against its request's cached keys (on CUDA the
    Triton kernel, in place). Off CUDA the rows of a continued prompt come first, and
    each such request's blocks are gathered once for all of its rows."""
    tables, lengths = batch.tables, batch.lengths
    assert tables is not None and lengths is not None
    if batch.triton:
        return paged_decode(q, k_cache, v_cache, tables, lengths)
    if not batch.extend:
        return _decode_gather(q, k_cache, v_cache, tables, lengths)
    out = torch.empty_like(q)
    for a, b, context in batch.extend:
        out[a:b] = _extend_gather(q[a:b], k_cache, v_cache, tables[a], lengths[a:b], context)
    rest = batch.extend[-1][1]
    if rest < q.shape[0]:
        out[rest:] = _decode_gather(q[rest:], k_cache, v_cache, tables[rest:], lengths[rest:])
    return out


def _extend_gather(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    lengths: torch.Tensor,
    context: int,
) -> torch.Tensor:
    """The fresh tokens of one continued prompt: each query attends to the request's first
    `lengths[i]` positions (its own included), from its blocks gathered once."""
    block = k_cache.shape[1]
    blocks = table[: -(-context // block)].long()
    k = k_cache[blocks].flatten(0, 1)[:context]  # (positions, kv_heads, dim)
    v = v_cache[blocks].flatten(0, 1)[:context]
    mask = torch.arange(context, device=q.device)[None, :] < lengths[:, None]
    with sdpa_kernel(BACKENDS):
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            attn_mask=mask[None],
            enable_gqa=True,
        )
    return o.transpose(0, 1)


def _prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: tuple[int, ...]
) -> torch.Tensor:
    """Each prompt attends causally to itself: the prompts go through one SDPA call, padded
    to the longest (padding sits after each prompt, so the causal mask keeps real tokens
    off it)."""
    lens = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    if len(lens) > 1:
        return _prefill_padded(q, k, v, bounds, lens)
    out = torch.empty_like(q)
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        out[a:b] = _sdpa(q[a:b], k[a:b], v[a:b], causal=True)
    return out


@functools.lru_cache(maxsize=4)
def _pad_index(bounds: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Where each prompt token sits in the (prompts x longest) padded layout: computed once a
    step, shared by every layer."""
    lens = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    width = max(lens)
    return torch.tensor(
        [i * width + t for i, m in enumerate(lens) for t in range(m)], device=device
    )


def _prefill_padded(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: tuple[int, ...], lens: list[int]
) -> torch.Tensor:
    n, width = len(lens), max(lens)
    where = _pad_index(bounds, q.device)

    def pad(x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(n * width, *x.shape[1:])
        out.index_copy_(0, where, x)
        return out.view(n, width, *x.shape[1:]).transpose(1, 2)

    with sdpa_kernel(BACKENDS):
        o = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), is_causal=True, enable_gqa=True)
    return o.transpose(1, 2).reshape(n * width, *q.shape[1:]).index_select(0, where)


def _decode_gather(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
) -> torch.Tensor:
    """Every request's blocks gathered into one padded batch, one masked SDPA call."""
    block = k_cache.shape[1]
    width = -(-int(lengths.max()) // block)
    blocks = tables[:, :width].long()
    k = k_cache[blocks].flatten(1, 2).transpose(1, 2)  # (requests, kv_heads, positions, dim)
    v = v_cache[blocks].flatten(1, 2).transpose(1, 2)
    mask = torch.arange(width * block, device=q.device)[None, :] < lengths[:, None]
    # positions past a request's length hold whatever was there (never-written memory can
    # be NaN, and a masked NaN score is still NaN): zero them before they meet the query
    keep = mask[:, None, :, None]
    k, v = torch.where(keep, k, 0.0), torch.where(keep, v, 0.0)
    with sdpa_kernel(BACKENDS):
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), k, v, attn_mask=mask[:, None, None, :], enable_gqa=True
        )
    return o.squeeze(2)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool) -> torch.Tensor:
    """(n, heads, dim) x (m, kv_heads, dim): grouped-query attention, heads first inside."""
    with sdpa_kernel(BACKENDS):
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            is_causal=causal,
            enable_gqa=True,
        )
    return o.transpose(0, 1)


def use_kernel(device: torch.device) -> bool:
    return device.type == "cuda" and triton_ready()
