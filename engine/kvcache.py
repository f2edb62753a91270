"""The paged KV cache: fixed-size blocks preallocated once, and who owns which block.

Allocated once at start from a byte budget (`--kv-cache-mb`). Each layer's keys and values
live in a tensor of shape (blocks + 1, block_size, kv_heads, head_dim); a token's slot is
block * block_size + offset. The extra last block is scratch: padded rows of a captured
decode batch write there, so no real request's keys are ever touched by padding.

`BlockAllocator` is plain Python (no torch): the scheduler asks it for blocks when it admits a
request and gives them back when the request ends.
"""

from __future__ import annotations

import math

import torch

from engine.errors import EngineError

BLOCK_SIZE = 16


def blocks_for(tokens: int, block_size: int = BLOCK_SIZE) -> int:
    return max(1, math.ceil(tokens / block_size))


class BlockAllocator:
    """Free-list allocator of block ids [0, total)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self._free = list(range(total - 1, -1, -1))  # pop() hands out low ids first

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.total - len(self._free)

    def take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise EngineError(f"asked for {n} KV blocks with {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def give_back(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


def bytes_per_block(
    layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int = BLOCK_SIZE
) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * layers * block_size * kv_heads * head_dim * itemsize


class KVCache:
    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        budget_mb: int,
        dtype: torch.dtype,
        device: torch.device | str,
        block_size: int = BLOCK_SIZE,
    ) -> None:
        device = torch.device(device)
        per_block = bytes_per_block(layers, kv_heads, head_dim, dtype, block_size)
        budget = budget_mb << 20
        self.blocks = budget // per_block - 1  # one block is scratch
        if self.blocks < 1:
            raise EngineError(
                f"--kv-cache-mb {budget_mb} holds no KV block: one block of {block_size} "
                f"tokens needs {math.ceil(2 * per_block / (1 << 20))} MB; raise --kv-cache-mb"
            )
        check_fits(budget, device, budget_mb)
        shape = (layers, self.blocks + 1, block_size, kv_heads, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.block_size = block_size
        self.scratch_slot = self.blocks * block_size
        self.bytes = 2 * self.k.numel() * self.k.element_size()

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size


def check_fits(budget: int, device: torch.device, budget_mb: int) -> None:
    """On a GPU, the budget must fit what is free now (weights already mapped)."""
    if device.type != "cuda":
        return
    free, total = torch.cuda.mem_get_info(device)
    if budget > free:
        raise EngineError(
            f"--kv-cache-mb {budget_mb} does not fit {device}: {free >> 20} MB free of "
            f"{total >> 20} MB; lower --kv-cache-mb (or the policy's engines memory_mb)"
        )
