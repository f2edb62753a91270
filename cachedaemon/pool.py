"""The pool: a few large backend chunks holding every tensor at an aligned offset.

`build_pool` lays the pool out from the plan (headers only, `pool_plan.layout`), allocates the chunks, fills
them tensor by tensor (digesting the checkpoint's bytes as they are read), checksums and
seals. `views` turns chunks + manifest into tensors
without copying; daemon and client both use it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from cachedaemon.backends import Backend, Mapping, OwnedChunk
from cachedaemon.config import LoadOptions
from cachedaemon.digest import Digester, FileDigest
from cachedaemon.manifest import ChunkEntry, Manifest, TensorEntry
from cachedaemon.pool_plan import layout
from cachedaemon.strides import contiguous_stride

if TYPE_CHECKING:  # torch loads only to build a pool or views, never to serve a reclaimed one
    import torch

    from cachedaemon.checkpoint import CheckpointReader
    from cachedaemon.pool_plan import SourcePlan
    from cachedaemon.progress import ByteProgress

log = structlog.get_logger("cachedaemon.pool")


def views(manifest: Manifest, chunks: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors over the chunks' flat uint8 tensors, as the manifest places them. No copy."""

    from cachedaemon.loader import dtype_of

    out = {}
    typed: dict[tuple[int, str], torch.Tensor] = {}  # one typed view per (chunk, dtype)
    for e in manifest.tensors:
        key = (e.chunk, e.dtype)
        base = typed.get(key)
        if base is None:
            base = typed[key] = chunks[e.chunk].view(dtype_of(e.dtype))
        out[e.name] = base.as_strided(e.shape, e.stride, e.offset // base.element_size())
    return out


class Pool:
    """A daemon's pool: the chunks (owned, or mapped from escrow) and their manifest."""

    def __init__(self, manifest: Manifest, chunks: Sequence[Mapping], fds: Sequence[int]) -> None:
        self.manifest = manifest
        self.chunks = list(chunks)
        self.fds = list(fds)

    def tensors(self) -> dict[str, torch.Tensor]:
        return views(self.manifest, [c.tensor for c in self.chunks])

    def bad_tensors(self, backend: Backend) -> list[str]:
        """Names whose bytes no longer match the manifest's checksums."""
        return [
            name for name, ok in _checksums(self.manifest, self.chunks, backend).items() if not ok
        ]

    def close(self) -> None:
        """Unmap every chunk and close the fds (an owned chunk closes its own)."""
        for chunk, fd in zip(self.chunks, self.fds, strict=True):
            chunk.close()
            if not isinstance(chunk, OwnedChunk):
                os.close(fd)
        self.chunks, self.fds = [], []


def _checksums(manifest: Manifest, chunks: Sequence[Mapping], backend: Backend) -> dict[str, bool]:
    entries = manifest.tensors
    if backend.name == "memfd":  # crc32 releases the GIL: spread it over threads
        with ThreadPoolExecutor(max_workers=4) as ex:
            sums = list(
                ex.map(
                    lambda e: backend.checksum_region(chunks[e.chunk], e.offset, e.nbytes), entries
                )
            )
    else:  # one batched pass on the device
        sums = backend.checksums(
            [chunks[e.chunk].tensor[e.offset : e.offset + e.nbytes] for e in entries]
        )
    return {e.name: s == e.checksum for e, s in zip(entries, sums, strict=True)}


def build_pool(
    model_dir: str | Path,
    opts: LoadOptions,
    backend: Backend,
    fingerprint: str,
    progress: ByteProgress | None = None,
    digest: bool = True,
) -> tuple[Pool, int]:
    """Load the checkpoint into a new sealed pool. Returns the pool and bytes read from disk.
    `digest=False` leaves out the content digest of the checkpoint's files (such a pool
    cannot be verified by content: bench/load_digest.py's baseline, never the daemon's)."""
    from cachedaemon.checkpoint import CheckpointReader
    from cachedaemon.pool_plan import plan

    t0 = time.perf_counter()
    with CheckpointReader(model_dir) as reader:
        plans = plan(reader, opts)
        specs = [o for sp in plans for o in sp.outputs]
        if progress is not None:
            progress.set_total(reader.total_bytes)
        places, used = layout(specs, backend)
        chunks: list[OwnedChunk] = []
        digester = (
            Digester(reader.model_dir / "config.json", reader.files, reader.tensors.values())
            if digest
            else None
        )
        try:
            chunks = [backend.create(u) for u in used]
            entries = _filler(backend)(
                reader,
                plans,
                opts,
                chunks,
                places,
                backend,
                progress.advance if progress else None,
                digester=digester,
            )
            files = digester.result() if digester is not None else ()
        except BaseException:
            if digester is not None:
                digester.close()
            for c in chunks:
                c.close()
            raise
        pool = sealed(chunks, used, backend, fingerprint, opts.device, entries, files)
        log.info(
            "pool built",
            tensors=len(entries),
            chunks=len(chunks),
            pool_bytes=pool.manifest.pool_bytes,
            seconds=round(time.perf_counter() - t0, 3),
        )
        return pool, reader.bytes_read


def sealed(
    chunks: list[OwnedChunk],
    used: Sequence[int],
    backend: Backend,
    fingerprint: str,
    device: str,
    tensors: Sequence[TensorEntry],
    files: tuple[FileDigest, ...],
) -> Pool:
    """The filled `chunks` sealed (read-only from now on) as one pool with its manifest."""
    for c in chunks:
        c.seal()
    manifest = Manifest(
        fingerprint=fingerprint,
        backend=backend.name,
        device=device,
        checksum_algo=backend.checksum_algo,
        chunks=tuple(ChunkEntry(c.size, u) for c, u in zip(chunks, used, strict=True)),
        tensors=tuple(tensors),
        files=files,
    )
    return Pool(manifest, chunks, [c.fd for c in chunks])


def _filler(backend: Backend) -> Callable[..., list[TensorEntry]]:
    """The GPU pool fills on parallel pinned readers; the CPU pool reads straight in."""
    if backend.name == "cuda-vmm":
        from cachedaemon.cuda_load import fill_parallel

        return fill_parallel
    return _fill


def _fill(
    reader: CheckpointReader,
    plans: list[SourcePlan],
    opts: LoadOptions,
    chunks: Sequence[OwnedChunk],
    places: list[tuple[int, int, int]],
    backend: Backend,
    on_bytes: Callable[[int], None] | None,
    *,
    digester: Digester | None = None,
) -> list[TensorEntry]:
    from cachedaemon.loader import read_source, transform

    if digester is not None:  # every read_into below: hashed on the digest threads
        reader.on_read = digester.add
    entries = []
    slots = iter(places)
    for sp in plans:
        regions = []
        for spec in sp.outputs:
            chunk, offset, nbytes = next(slots)
            regions.append((spec, chunk, offset, chunks[chunk].tensor[offset : offset + nbytes]))
        if _is_plain_copy(sp) and regions[0][3].device.type == "cpu":
            reader.read_into(sp.info, regions[0][3].numpy().data)  # straight into the pool
        else:
            for (_, _, _, region), t in zip(
                regions, transform(read_source(reader, sp.info), sp, opts), strict=True
            ):
                region.view(t.dtype).view(t.shape).copy_(t)
        entries += [
            TensorEntry(
                name=spec.name,
                chunk=chunk,
                offset=offset,
                dtype=spec.dtype,
                shape=spec.shape,
                stride=contiguous_stride(spec.shape),
                nbytes=region.numel(),
                checksum=backend.checksum(region),
            )
            for spec, chunk, offset, region in regions
        ]
        if on_bytes:
            on_bytes(sp.info.nbytes)
    return entries


def _is_plain_copy(sp: SourcePlan) -> bool:
    """The pool bytes equal the file bytes: no shard, no dtype change, no transform."""
    return sp.dim is None and len(sp.outputs) == 1 and sp.outputs[0].dtype == sp.info.dtype
