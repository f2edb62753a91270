"""From checkpoint bytes to the tensors a rank serves: dtype, TP shard, post-load transform.

`plan` (cachedaemon/pool_plan.py, torch-free) works out every output tensor's name, dtype
and shape from the headers alone (so the pool can be laid out before any data is read);
`produce` then reads and transforms one source tensor at a time. `load_state_dict` runs the
same pipeline into ordinary memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import torch

import cachedaemon.quant as quant
from cachedaemon.checkpoint import CheckpointReader, TensorInfo
from cachedaemon.config import LoadOptions
from cachedaemon.errors import CacheError
from cachedaemon.pool_plan import OutSpec, SourcePlan, plan

__all__ = [
    "LoadOptions",
    "OutSpec",
    "SourcePlan",
    "load_state_dict",
    "plan",
    "produce",
    "transform",
]


def dtype_of(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise CacheError(f"unknown dtype {name!r}")
    return dt


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
