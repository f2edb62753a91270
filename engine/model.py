"""A Llama-family decoder (RMSNorm, rotary, grouped-query attention, SwiGLU), tensor parallel.

Built on the meta device with the shapes of one rank's shard and HF tensor names, so
`attach_model` can replace every parameter with a view of the daemon's pool. Column-parallel
projections (q/k/v/gate/up) hold rows of this rank; row-parallel ones (o/down) hold columns
and all-reduce; embeddings and lm_head are vocab-parallel. fp8-block weights are dequantized
on use, one projection at a time, so the shared pool is never copied whole.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engine import fused, gemv
from engine.attention import Batch, attend
from engine.kvcache import KVCache
from engine.modelargs import ModelArgs

BLOCK = 128
KVPair = tuple[torch.Tensor, torch.Tensor]  # one layer's key and value cache


class TPGroup:
    """This process's place in the tensor-parallel group; collectives are no-ops at size 1."""

    def __init__(self, rank: int = 0, size: int = 1) -> None:
        self.rank, self.size = rank, size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


def _meta(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device="meta"), requires_grad=False)


def dequantize(w: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8 weight * its 128x128 block scale, in the compute dtype."""
    rows, cols = w.shape
    scale = scale_inv.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]
    return (w.float() * scale).to(dtype)


class Linear(nn.Module):
    def __init__(
        self, rows: int, cols: int, dtype: torch.dtype, *, bias: bool = False, fp8: bool = False
    ) -> None:
        super().__init__()
        self.dtype = dtype
        self.weight = _meta(rows, cols, dtype=torch.float8_e4m3fn if fp8 else dtype)
        self.bias = _meta(rows, dtype=dtype) if bias else None
        self.weight_scale_inv = (
            _meta(math.ceil(rows / BLOCK), math.ceil(cols / BLOCK), dtype=torch.float32)
            if fp8
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w: torch.Tensor = self.weight
        if self.weight_scale_inv is not None:
            w = dequantize(w, self.weight_scale_inv, self.dtype)
        return gemv.linear(x, w, self.bias)


def side_by_side(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    """One view of tensors that lie one after another in one storage, their rows stacked
    (a pool lays q|k|v and gate|up so: cachedaemon/pool_plan.py SIDE_BY_SIDE); None where
    they do not (tensors of their own, a gap, another dtype or width). Never a copy."""
    if not parts or any(p is None or p.is_meta for p in parts):
        return None
    first = parts[0]
    assert first is not None
    storage, at = first.untyped_storage().data_ptr(), first.data_ptr()
    for p in parts:
        assert p is not None
        if (
            p.dtype != first.dtype
            or p.shape[1:] != first.shape[1:]
            or not p.is_contiguous()
            or p.untyped_storage().data_ptr() != storage
            or p.data_ptr() != at
        ):
            return None
        at += p.nbytes
    rows = sum(p.shape[0] for p in parts if p is not None)
    return first.detach().as_strided(
        (rows, *first.shape[1:]), first.stride(), first.storage_offset()
    )


class Fused:
    """Linears of one input read as one matrix: one product instead of several, each
    part's columns of the output a view of it."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, sizes: tuple[int, ...]):
        self.weight, self.bias, self.sizes = weight, bias, sizes

    @classmethod
    def of(cls, linears: list[Linear]) -> Fused | None:
        if any(lin.weight_scale_inv is not None for lin in linears):
            return None  # fp8 weights are dequantized one projection at a time
        weight = side_by_side([lin.weight for lin in linears])
        has_bias = linears[0].bias is not None
        bias = side_by_side([lin.bias for lin in linears]) if has_bias else None
        if weight is None or (has_bias and bias is None):
            return None
        return cls(weight, bias, tuple(lin.weight.shape[0] for lin in linears))

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.split(gemv.linear(x, self.weight, self.bias), list(self.sizes), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _meta(dim, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.rms_norm_torch(x, self.weight, self.eps)

    def add_forward(
        self, x: torch.Tensor, delta: torch.Tensor | None, triton: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + delta), x + delta), in one kernel when `triton`."""
        if triton:
            return fused.add_rms_norm(x, delta, self.weight, self.eps)
        if delta is not None:
            x = x + delta
        return self.forward(x), x


def inv_freq(args: ModelArgs) -> torch.Tensor:
    """Rotary frequencies, with Llama 3's wavelength-dependent scaling when configured."""
    dim = args.head_dim
    freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = args.rope_scaling
    if s.rope_type != "llama3":
        return freq
    low_wl = s.original_max_position_embeddings / s.low_freq_factor
    high_wl = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_wl, freq / s.factor, freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    mid = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_mid = (wavelen >= high_wl) & (wavelen <= low_wl)
    return torch.where(is_mid, mid, scaled)


class Attention(nn.Module):
    def __init__(self, a: ModelArgs, tp: TPGroup, dtype: torch.dtype, fp8: bool) -> None:
        super().__init__()
        self.tp, self.head_dim = tp, a.head_dim
        self.heads, self.kv_heads = (
            a.num_attention_heads // tp.size,
            a.num_key_value_heads // tp.size,
        )
        q, kv = self.heads * a.head_dim, self.kv_heads * a.head_dim
        bias = a.attention_bias
        self.q_proj = Linear(q, a.hidden_size, dtype, bias=bias, fp8=fp8)
        self.k_proj = Linear(kv, a.hidden_size, dtype, bias=bias, fp8=fp8)
        self.v_proj = Linear(kv, a.hidden_size, dtype, bias=bias, fp8=fp8)
        self.o_proj = Linear(a.hidden_size, q, dtype, fp8=fp8)
        self.qkv: Fused | None = None  # q|k|v as one product, once `fuse` finds them so

    def fuse(self) -> bool:
        self.qkv = Fused.of([self.q_proj, self.k_proj, self.v_proj])
        return self.qkv is not None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: Batch, kv: KVPair
    ) -> torch.Tensor:
        n = x.shape[0]
        if self.qkv is not None:
            q, k, v = self.qkv(x)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(n, self.heads, self.head_dim)
        k = k.view(n, self.kv_heads, self.head_dim)
        v = v.view(n, self.kv_heads, self.head_dim)
        if batch.triton:  # cos, sin: per token, or each position's rows (`rotations`)
            at = batch.positions if cos.dim() == 2 else None
            fused.rope_store(q, k, v, cos, sin, kv[0], kv[1], batch.slots, at)
        else:
            q, k = fused.rotate_torch(q, cos, sin), fused.rotate_torch(k, cos, sin)
        out = attend(q, k, v, kv[0], kv[1], batch)
        return self.tp.all_reduce(self.o_proj(out.reshape(n, -1)))


class MLP(nn.Module):
    def __init__(self, a: ModelArgs, tp: TPGroup, dtype: torch.dtype, fp8: bool) -> None:
        super().__init__()
        self.tp = tp
        inter = a.intermediate_size // tp.size
        self.gate_proj = Linear(inter, a.hidden_size, dtype, fp8=fp8)
        self.up_proj = Linear(inter, a.hidden_size, dtype, fp8=fp8)
        self.down_proj = Linear(a.hidden_size, inter, dtype, fp8=fp8)
        self.gate_up: Fused | None = None  # gate|up as one product, once `fuse` finds them so

    def fuse(self) -> bool:
        self.gate_up = Fused.of([self.gate_proj, self.up_proj])
        return self.gate_up is not None

    def forward(self, x: torch.Tensor, triton: bool = False) -> torch.Tensor:
        if self.gate_up is not None:
            gate, up = self.gate_up(x)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        act = fused.silu_mul if triton else fused.silu_mul_torch
        return self.tp.all_reduce(self.down_proj(act(gate, up)))


class DecoderLayer(nn.Module):
    def __init__(self, a: ModelArgs, tp: TPGroup, dtype: torch.dtype, fp8: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype)
        self.self_attn = Attention(a, tp, dtype, fp8)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype)
        self.mlp = MLP(a, tp, dtype, fp8)

    def forward(
        self,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: Batch,
        kv: KVPair,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual stream, this layer's MLP output): the next layer adds the second to the
        first in the kernel that normalises it."""
        h, x = self.input_layernorm.add_forward(x, delta, batch.triton)
        attn = self.self_attn(h, cos, sin, batch, kv)
        h, x = self.post_attention_layernorm.add_forward(x, attn, batch.triton)
        return x, self.mlp(h, batch.triton)


class Embedding(nn.Module):
    """Vocab-parallel: this rank holds rows [rank*V/tp, (rank+1)*V/tp) and all-reduces."""

    def __init__(self, vocab: int, dim: int, tp: TPGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp, self.rows = tp, vocab // tp.size
        self.weight = _meta(self.rows, dim, dtype=dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.tp.rank * self.rows
        inside = (local >= 0) & (local < self.rows)
        out = F.embedding(local.clamp(0, self.rows - 1), self.weight)
        return self.tp.all_reduce(out * inside.unsqueeze(-1).to(out.dtype))


class LlamaModel(nn.Module):
    def __init__(self, a: ModelArgs, tp: TPGroup, dtype: torch.dtype, fp8: bool) -> None:
        super().__init__()
        self.embed_tokens = Embedding(a.vocab_size, a.hidden_size, tp, dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(a, tp, dtype, fp8) for _ in range(a.num_hidden_layers)
        )
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype)


class LlamaForCausalLM(nn.Module):
    """HF-named decoder; `forward` runs one scheduler step for a batch."""

    def __init__(
        self,
        a: ModelArgs,
        tp: TPGroup,
        dtype: torch.dtype,
        *,
        fp8: bool = False,
        device: str = "cpu",
    ) -> None:
        super().__init__()
        self.args, self.tp, self.dtype = a, tp, dtype
        self.model = LlamaModel(a, tp, dtype, fp8)
        self.lm_head = (
            None if a.tie_word_embeddings else Linear(a.vocab_size // tp.size, a.hidden_size, dtype)
        )
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv_freq(a).to(device), persistent=False)
        self.rotation: tuple[torch.Tensor, torch.Tensor] | None = None  # (`rotations`)

    def fuse_projections(self) -> int:
        """Read q|k|v and gate|up as one matrix each wherever the weights lie side by side
        (views of one pool: no copy); how many groups are read so. Call again after the
        weights are put in place anew (a refit maps new weights at the same addresses)."""
        groups = 0
        for layer in self.model.layers:
            assert isinstance(layer, DecoderLayer)
            groups += int(layer.self_attn.fuse()) + int(layer.mlp.fuse())
        return groups

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape (tokens, 1, head_dim): they broadcast over heads."""
        freqs = positions.float()[:, None] * self.inv_freq.view(1, -1)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def rotations(self, max_len: int) -> None:
        """Keep cos and sin of every position below `max_len`, (max_len, head_dim) each,
        made by `_rotary`'s math (the same values): steps on the CUDA kernels then look up
        each token's row in `fused.rope_store`, not compute them in seven small kernels."""
        positions = torch.arange(max_len, device=self.inv_freq.device)
        cos, sin = self._rotary(positions)
        self.rotation = (cos[:, 0], sin[:, 0])

    def forward(self, ids: torch.Tensor, batch: Batch, cache: KVCache) -> torch.Tensor:
        """One step for a whole batch: (requests, vocab) logits, one row per request (its
        last token): float32, or the head's dtype for the sampling kernels
        (`batch.triton`, engine/sampling.py: they read it once as it is). Keys and values
        of every token go to the cache on the way."""
        if batch.triton and self.rotation is not None:
            cos, sin = self.rotation  # each position's rows: rope_store looks them up
        else:
            cos, sin = self._rotary(batch.positions)
        x = self.model.embed_tokens(ids)
        delta: torch.Tensor | None = None
        for i, layer in enumerate(self.model.layers):
            x, delta = layer(x, delta, cos, sin, batch, (cache.k[i], cache.v[i]))
        last = batch.last
        tail = delta.index_select(0, last) if delta is not None else None
        h, _ = self.model.norm.add_forward(x.index_select(0, last), tail, batch.triton)
        head = self.lm_head.weight if self.lm_head is not None else self.model.embed_tokens.weight
        logits = self.tp.all_gather_last(gemv.linear(h, head))
        return logits if batch.triton else logits.float()
