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
    """Free-list allocator of block ids [0, total): blocks given back are handed out again
    first (the last given back first), then the lowest never handed out. Made in O(1),
    whatever `total` (a cache taken over at a promotion gets one at once)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self._free: list[int] = []  # given back
        self._next = 0  # blocks [_next, total) were never handed out...
        self._ahead: set[int] = set()  # ...but these of them, which `reserve` took
        self._count = total

    @property
    def free(self) -> int:
        return self._count

    @property
    def used(self) -> int:
        return self.total - self._count

    def take(self, n: int) -> list[int]:
        if n > self._count:
            raise EngineError(f"asked for {n} KV blocks with {self._count} free")
        out: list[int] = []
        while len(out) < n:
            if self._free:
                out.append(self._free.pop())
                continue
            block, self._next = self._next, self._next + 1
            if block in self._ahead:
                self._ahead.discard(block)
            else:
                out.append(block)
        self._count -= n
        return out

    def give_back(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
        self._count += len(blocks)

    def reserve(self, blocks: list[int]) -> None:
        """Take these very blocks (an adopted cache's, in use already); each is free."""
        given = set(blocks).intersection(self._free)
        if given:
            self._free = [b for b in self._free if b not in given]
        self._ahead.update(b for b in blocks if b >= self._next)
        self._count -= len(blocks)


def bytes_per_block(
    layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int = BLOCK_SIZE
) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * layers * block_size * kv_heads * head_dim * itemsize


def blocks_in(
    budget_mb: int, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int
) -> int:
    """Usable blocks a budget of `budget_mb` holds (one more is scratch)."""
    per_block = bytes_per_block(layers, kv_heads, head_dim, dtype, block_size)
    blocks = (budget_mb << 20) // per_block - 1
    if blocks < 1:
        raise EngineError(
            f"--kv-cache-mb {budget_mb} holds no KV block: one block of {block_size} "
            f"tokens needs {math.ceil(2 * per_block / (1 << 20))} MB; raise --kv-cache-mb"
        )
    return blocks


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
        *,
        tensors: tuple[torch.Tensor, torch.Tensor] | None = None,
        usable: int | None = None,
    ) -> None:
        """`tensors`: the keys' and values' tensors, of this shape, made elsewhere (a
        shared cache, engine/kvshare.py); else allocated here. `usable`: the blocks that
        may be handed out, when fewer than the shape holds (a standby's on a GPU, whose
        other blocks have no memory under them yet); all by default."""
        device = torch.device(device)
        self.blocks = blocks_in(budget_mb, layers, kv_heads, head_dim, dtype, block_size)
        shape = (layers, self.blocks + 1, block_size, kv_heads, head_dim)
        if tensors is None:
            check_fits(budget_mb << 20, device, budget_mb)
            tensors = (
                torch.empty(shape, dtype=dtype, device=device),
                torch.empty(shape, dtype=dtype, device=device),
            )
        elif tensors[0].shape != shape or tensors[1].shape != shape:
            raise EngineError(f"a shared KV cache of shape {tuple(tensors[0].shape)}, not {shape}")
        self.k, self.v = tensors
        self.usable = self.blocks if usable is None else min(usable, self.blocks)
        self.block_size = block_size
        self.scratch_slot = self.blocks * block_size
        self.bytes = 2 * self.k.numel() * self.k.element_size()

    @property
    def tokens(self) -> int:
        return self.usable * self.block_size


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
