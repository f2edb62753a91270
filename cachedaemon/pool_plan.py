"""What a rank's pool holds and where, from the checkpoint's headers alone, without torch:
`plan` (every output tensor's name, dtype and shape for the load options), `layout` (the
chunks and aligned offsets `build_pool` fills) and `pool_bytes` (what the pool takes, as
its manifest's `pool_bytes` will say). The loader and the pool build from these; the
supervisor sizes a pool before it asks for one (supervisor/update/memory.py)."""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import msgspec

import cachedaemon.quant as quant
from cachedaemon.checkpoint import ST_DTYPES, CheckpointReader, TensorInfo
from cachedaemon.config import DTYPES, LoadOptions
from cachedaemon.errors import CacheError
from cachedaemon.sharding import shard_dim, shard_shape

FLOAT_SOURCES = ("float64", "float32", "float16", "bfloat16")
ITEMSIZE: dict[str, int] = dict(ST_DTYPES.values())  # torch dtype name -> bytes


class OutSpec(msgspec.Struct, frozen=True):
    name: str
    dtype: str
    shape: tuple[int, ...]


class SourcePlan(msgspec.Struct, frozen=True):
    info: TensorInfo
    dim: int | None  # shard dim, None when replicated
    outputs: tuple[OutSpec, ...]  # 1, or 2 for fp8 (weight, scale)


class Chunking(Protocol):
    """How a backend lays a pool out: tensor offsets aligned to `alignment` in chunks of
    at most `max_chunk_bytes` (a `Backend`, or a backend's `Geometry`)."""

    @property
    def alignment(self) -> int: ...

    @property
    def max_chunk_bytes(self) -> int: ...


class Geometry(msgspec.Struct, frozen=True):
    """A backend's chunking, and the allocation size a chunk is rounded up to."""

    alignment: int = 256
    max_chunk_bytes: int = 1 << 30
    granularity: int = mmap.PAGESIZE

    def round_size(self, size: int) -> int:
        g = self.granularity
        return max(g, -(-size // g) * g)


# each backend's, by name; the backends take their chunking from here. cuda-vmm's
# granularity is the driver's (cuMemGetAllocationGranularity, asked by the daemon): 2 MiB
# on every GPU holdfast runs on, and the figure assumed where the driver is not asked.
GEOMETRY: dict[str, Geometry] = {
    "memfd": Geometry(),
    "cuda-vmm": Geometry(max_chunk_bytes=4 << 30, granularity=2 << 20),
}


def itemsize(dtype: str) -> int:
    try:
        return ITEMSIZE[dtype]
    except KeyError:
        raise CacheError(f"unknown dtype {dtype!r}") from None


# Projections an engine multiplies by one input, kept side by side in a pool (in this
# order, at the place of the first one the checkpoint lists), so that an engine reads each
# group as one matrix with no copy (engine/model.py `fuse_projections`): q|k|v, gate|up.
SIDE_BY_SIDE = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _group(name: str) -> tuple[str, int, str, int] | None:
    """(prefix, group, suffix, place in the group) of a projection of SIDE_BY_SIDE, by its
    name's parts ("model.layers.3.self_attn" "k_proj" "weight"); None for any other."""
    parts = name.split(".")
    for g, members in enumerate(SIDE_BY_SIDE):
        for i, part in enumerate(parts):
            if part in members:
                return ".".join(parts[:i]), g, ".".join(parts[i + 1 :]), members.index(part)
    return None


def side_by_side(names: Sequence[str]) -> list[int]:
    """The order (indices into `names`) that puts each group of SIDE_BY_SIDE together, in
    the group's order, where its first member was; every other name keeps its place."""
    groups: dict[tuple[str, int, str], list[tuple[int, int]]] = {}
    for i, name in enumerate(names):
        g = _group(name)
        if g is not None:
            groups.setdefault(g[:3], []).append((g[3], i))
    out: list[int] = []
    placed = set()
    for i, name in enumerate(names):
        g = _group(name)
        if g is None:
            out.append(i)
        elif g[:3] not in placed:
            placed.add(g[:3])
            out.extend(j for _, j in sorted(groups[g[:3]]))
    return out


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
    return [out[i] for i in side_by_side([sp.info.name for sp in out])]


def layout(
    specs: Sequence[OutSpec], chunking: Chunking
) -> tuple[list[tuple[int, int, int]], list[int]]:
    """(chunk, offset, nbytes) per spec, and each chunk's used bytes. Greedy, in order."""
    places: list[tuple[int, int, int]] = []
    used: list[int] = []
    align, most = chunking.alignment, chunking.max_chunk_bytes
    for spec in specs:
        nbytes = math.prod(spec.shape) * itemsize(spec.dtype)
        offset = -(-used[-1] // align) * align if used else 0
        if not used or (offset + nbytes > most and used[-1] > 0):
            used.append(0)
            offset = 0
        places.append((len(used) - 1, offset, nbytes))
        used[-1] = offset + nbytes
    return places, used


def pool_bytes(model_dir: str | Path, opts: LoadOptions, backend: str) -> int:
    """The bytes a pool of `model_dir` made with `opts` on `backend` takes (its chunks,
    each rounded to the backend's allocation size), from the safetensors headers: no
    tensor is read. A pool in vLLM's layout holds the same tensors fused (qkv_proj,
    gate_up_proj): the same bytes to within the alignment."""
    if backend not in GEOMETRY:
        raise CacheError(f"unknown backend {backend!r}; choose one of {', '.join(GEOMETRY)}")
    geometry = GEOMETRY[backend]
    with CheckpointReader(model_dir) as reader:
        specs = [o for sp in plan(reader, opts) for o in sp.outputs]
    _, used = layout(specs, geometry)
    return sum(geometry.round_size(u) for u in used)
