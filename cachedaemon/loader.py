"""From checkpoint bytes to the tensors a rank serves: dtype, TP shard, post-load transform.

`plan` works out every output tensor's name, dtype and shape from the headers alone (so the
pool can be laid out before any data is read); `produce` then reads and transforms one
source tensor at a time. `load_state_dict` runs the same pipeline into ordinary memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import torch

import cachedaemon.quant as quant
from cachedaemon.checkpoint import CheckpointReader, TensorInfo
from cachedaemon.config import DTYPES, LoadOptions

__all__ = [
    "LoadOptions",
    "OutSpec",
    "SourcePlan",
    "load_state_dict",
    "plan",
    "produce",
    "transform",
]
from cachedaemon.errors import CacheError
from cachedaemon.sharding import shard_dim, shard_shape

FLOAT_SOURCES = ("float64", "float32", "float16", "bfloat16")


class OutSpec(msgspec.Struct, frozen=True):
    name: str
    dtype: str
    shape: tuple[int, ...]


class SourcePlan(msgspec.Struct, frozen=True):
    info: TensorInfo
    dim: int | None  # shard dim, None when replicated
    outputs: tuple[OutSpec, ...]  # 1, or 2 for fp8 (weight, scale)


def dtype_of(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise CacheError(f"unknown dtype {name!r}")
    return dt


def plan(reader: CheckpointReader, opts: LoadOptions) -> list[SourcePlan]:
    if opts.dtype not in DTYPES:
        raise CacheError(f"unsupported dtype {opts.dtype!r}; choose one of {', '.join(DTYPES)}")
    quant.check_method(opts.quantization)
    out = []
    for info in reader.tensors.values():
        dim = shard_dim(info.name, opts.shard_rules) if opts.tp_size > 1 else None
        shape = shard_shape(info.name, info.shape, dim, opts.tp_size)
        dtype = opts.dtype if info.dtype in FLOAT_SOURCES else info.dtype
        if quant.quantizes(opts.quantization, info.name, shape):
            outputs: tuple[OutSpec, ...] = (
                OutSpec(info.name, "float8_e4m3fn", shape),
                OutSpec(info.name + "_scale_inv", "float32", quant.scale_shape(shape)),
            )
        else:
            outputs = (OutSpec(info.name, dtype, shape),)
        out.append(SourcePlan(info, dim, outputs))
    return out


def read_source(reader: CheckpointReader, info: TensorInfo) -> torch.Tensor:
    raw = torch.empty(info.nbytes, dtype=torch.uint8)
    reader.read_into(info, raw.numpy().data)
    return raw.view(dtype_of(info.dtype)).view(info.shape)


def transform(src: torch.Tensor, sp: SourcePlan, opts: LoadOptions) -> list[torch.Tensor]:
    """One source tensor (on the CPU) to its outputs, on opts.device, in plan order."""
    t = src
    if sp.dim is not None:
        size = t.shape[sp.dim] // opts.tp_size
        t = t.narrow(sp.dim, opts.tp_rank * size, size)
    t = t.to(opts.device, non_blocking=False)
    if len(sp.outputs) == 2:
        return list(quant.fp8_block_quantize(t))
    return [t.to(dtype_of(sp.outputs[0].dtype)).contiguous()]


def produce(
    reader: CheckpointReader,
    plans: list[SourcePlan],
    opts: LoadOptions,
    on_bytes: Callable[[int], None] | None = None,
) -> Iterator[tuple[OutSpec, torch.Tensor]]:
    for sp in plans:
        tensors = transform(read_source(reader, sp.info), sp, opts)
        yield from zip(sp.outputs, tensors, strict=True)
        if on_bytes:
            on_bytes(sp.info.nbytes)


def load_state_dict(
    model_dir: str | Path, opts: LoadOptions | None = None
) -> dict[str, torch.Tensor]:
    """The tensors a daemon would serve for `opts` (the defaults when None), loaded from
    disk into plain memory."""
    opts = opts or LoadOptions()
    with CheckpointReader(model_dir) as reader:
        plans = plan(reader, opts)
        return {spec.name: t for spec, t in produce(reader, plans, opts)}
