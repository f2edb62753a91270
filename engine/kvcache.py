"""A per-request KV cache: one preallocated (kv_heads, capacity, head_dim) slab per layer."""

from __future__ import annotations

import torch


class KVCache:
    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (kv_heads, capacity, head_dim)
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.capacity = capacity
        self.length = 0

    def append(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's keys/values for `layer`; return all keys/values so far."""
        end = self.length + k.shape[1]
        if end > self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} positions; asked for {end}")
        self.k[layer][:, self.length : end] = k
        self.v[layer][:, self.length : end] = v
        return self.k[layer][:, :end], self.v[layer][:, :end]

    def advance(self, n: int) -> None:
        self.length += n
