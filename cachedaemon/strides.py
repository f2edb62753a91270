"""How a tensor lies in a pool chunk: its row-major strides (the pool and the CUDA fill
both place tensors contiguously)."""

from __future__ import annotations


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a row-major (C-contiguous) tensor of `shape`, in elements."""
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(stride))
