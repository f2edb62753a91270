"""The GPU load path: parallel readers into pinned staging buffers, async copies to the GPU,
transforms (dtype, TP shard, fp8-block) on the GPU, checksums batched on the GPU beside the
copies still under way.

`fill_parallel` has the signature of `cachedaemon.pool._fill`, so `build_pool` can use it
for cuda-vmm pools. Each worker thread owns a CUDA stream and two pinned buffers: it
preads piece k+1 while piece k is copied to the device. A tensor that needs no transform
is copied straight into its place in the pool; one that does lands in a GPU scratch
tensor first and is transformed there, by the same `loader.transform` the CPU path uses.

The content digest (cachedaemon.digest) of a tensor copied as the file holds it is hashed
in the pool, on the GPU (`digest_in_pool`, cachedaemon.blake3_gpu: the same BLAKE3 as the
CPU's), a batch of tensors at a time once their copies are in, while the readers go on
(`_Hashing`); hashed on the host beside the reads, it made an H100's load of llama-8b 1.3x
as long, and hashed after the last copy, 1.6x. A transformed tensor's bytes are hashed by its reader,
slice by slice right after each pread (`Digester.read`), as is every tensor where Triton
is missing.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import structlog
import torch

from cachedaemon.backends.base import Backend, OwnedChunk
from cachedaemon.checkpoint import CheckpointReader, TensorInfo
from cachedaemon.cuda_checksum import ALGO, gpu_checksums
from cachedaemon.digest import PIECE, Digester
from cachedaemon.errors import CheckpointError
from cachedaemon.loader import LoadOptions, SourcePlan, dtype_of, transform
from cachedaemon.manifest import TensorEntry
from cachedaemon.strides import contiguous_stride

# readers, up to 16 where there are the cores: on a 16-core H100 host llama-8b loaded in
# 0.78 s with 16 against 0.90 s with 8
WORKERS = max(8, min(16, os.cpu_count() or 1))
Place = tuple[int, int, int]  # chunk, offset, nbytes
log = structlog.get_logger("cachedaemon.cuda_load")


class _Stager:
    """One worker's stream and double pinned buffers."""

    def __init__(self, device: torch.device, piece: int) -> None:
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self.bufs = [torch.empty(piece, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.views = [b.numpy().data for b in self.bufs]
        self.done: list[torch.cuda.Event | None] = [None, None]

    def copy_in(
        self, fd: int, info: TensorInfo, dst: torch.Tensor, digester: Digester | None
    ) -> None:
        """pread the tensor's bytes piece by piece and queue each piece's copy into `dst`;
        with `digester`, each slice hashed on this thread right after its pread."""
        piece = len(self.views[0])
        for k, start in enumerate(range(0, info.nbytes, piece)):
            n = min(piece, info.nbytes - start)
            slot = k % 2
            event = self.done[slot]
            if event is not None:
                event.synchronize()  # the copy out of this buffer has finished
            view = self.views[slot][:n]
            if digester is None:
                _pread_exact(fd, view, info.start + start, info)
            else:  # each slice hashed right after its pread, by this thread
                digester.read(
                    info, view, start, lambda v, at: _pread_exact(fd, v, info.start + at, info)
                )
            with torch.cuda.stream(self.stream):
                dst[start : start + n].copy_(self.bufs[slot][:n], non_blocking=True)
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(self.stream)
                self.done[slot] = event


def _pread_exact(fd: int, buf: memoryview, offset: int, info: TensorInfo) -> None:
    done = 0
    while done < len(buf):
        got = os.preadv(fd, [buf[done:]], offset + done)
        if got <= 0:
            raise CheckpointError(f"{info.path}: short read in tensor {info.name!r}; truncated?")
        done += got


def _needs_transform(sp: SourcePlan) -> bool:
    return sp.dim is not None or len(sp.outputs) > 1 or sp.outputs[0].dtype != sp.info.dtype


class _Job:
    def __init__(
        self,
        opts: LoadOptions,
        chunks: Sequence[OwnedChunk],
        fds: dict[str, int],
        piece: int,
        digester: Digester | None,
        gpu_digest: bool,
    ) -> None:
        self.opts, self.chunks, self.fds, self.piece = opts, chunks, fds, piece
        self.digester = digester
        self.gpu_digest = gpu_digest  # tensors copied as they are: hashed in the pool after
        self.device = torch.device(opts.device)
        self._local = threading.local()

    def stager(self) -> _Stager:
        st: _Stager | None = getattr(self._local, "stager", None)
        if st is None:
            st = self._local.stager = _Stager(self.device, self.piece)
        return st

    def region(self, place: Place) -> torch.Tensor:
        chunk, offset, nbytes = place
        return self.chunks[chunk].tensor[offset : offset + nbytes]

    def run(self, sp: SourcePlan, places: list[Place]) -> list[torch.Tensor]:
        """Load one source tensor into its places; returns the filled regions."""
        st = self.stager()
        regions = [self.region(p) for p in places]
        fd = self.fds[sp.info.path]
        if not _needs_transform(sp):
            st.copy_in(fd, sp.info, regions[0], None if self.gpu_digest else self.digester)
        else:
            with torch.cuda.stream(st.stream):
                raw = torch.empty(sp.info.nbytes, dtype=torch.uint8, device=self.device)
            st.copy_in(fd, sp.info, raw, self.digester)
            with torch.cuda.stream(st.stream):
                src = raw.view(dtype_of(sp.info.dtype)).view(sp.info.shape)
                outs = transform(src, sp, self.opts)
                for out, region, spec in zip(outs, regions, sp.outputs, strict=True):
                    region.view(dtype_of(spec.dtype)).view(spec.shape).copy_(out)
        st.stream.synchronize()
        return regions


HASH_BATCH = 1 << 30  # bytes of loaded tensors hashed in one go, while later ones copy


class _Hashing:
    """The GPU's hashing of what is loaded, beside the copies still under way: once
    HASH_BATCH bytes of tensors (in plan order) are in the pool, one thread of its own, on
    a CUDA stream of its own, hashes them (the digest of those copied as the file holds
    them, `digest_in_pool`, and every region's checksum), so the load ends about one
    batch's hashing after its last copy rather than after hashing the whole pool.
    Checksums and digests are per tensor: how tensors are batched changes none of them."""

    def __init__(self, job: _Job, backend: Backend, chunks: Sequence[OwnedChunk]) -> None:
        self.job, self.backend, self.chunks = job, backend, chunks
        self.on_gpu = backend.checksum_algo == ALGO
        self.digest_s = self.checksum_s = 0.0
        self._batch: tuple[list[SourcePlan], list[list[Place]], list[torch.Tensor]] = ([], [], [])
        self._bytes = 0
        self._sums: list[Future[list[str]]] = []
        self._ex = ThreadPoolExecutor(max_workers=1, thread_name_prefix="holdfast-hash")
        self._stream: torch.cuda.Stream | None = None

    def add(self, sp: SourcePlan, places: list[Place], regions: list[torch.Tensor]) -> None:
        """A source tensor's regions are in the pool (its copies finished)."""
        plans, per_plan, batch = self._batch
        plans.append(sp)
        per_plan.append(places)
        batch += regions
        self._bytes += sum(r.numel() for r in regions)
        if self._bytes >= HASH_BATCH:
            self._flush()

    def finish(self) -> list[str]:
        """Every region's checksum, in plan order, once all are hashed."""
        self._flush()
        return [s for fut in self._sums for s in fut.result()]

    def close(self) -> None:
        self._ex.shutdown(wait=True, cancel_futures=True)

    def _flush(self) -> None:
        if not self._batch[2]:
            return
        batch, self._batch, self._bytes = self._batch, ([], [], []), 0
        self._sums.append(self._ex.submit(self._hash, *batch))

    def _hash(
        self, plans: list[SourcePlan], per_plan: list[list[Place]], regions: list[torch.Tensor]
    ) -> list[str]:
        job = self.job
        if self._stream is None:
            self._stream = torch.cuda.Stream(job.device)  # type: ignore[no-untyped-call]
        # this thread's current device is its own: the pool's, for Triton's launches
        with torch.cuda.device(job.device), torch.cuda.stream(self._stream):
            t = time.perf_counter()
            if job.digester is not None and job.gpu_digest:
                digest_in_pool(job.digester, plans, per_plan, self.chunks)
            t2 = time.perf_counter()
            if self.on_gpu:
                sums = gpu_checksums(regions)  # one device sync per batch
            else:
                sums = [self.backend.checksum(r) for r in regions]
            self.digest_s += t2 - t
            self.checksum_s += time.perf_counter() - t2
        return sums


def fill_parallel(
    reader: CheckpointReader,
    plans: list[SourcePlan],
    opts: LoadOptions,
    chunks: Sequence[OwnedChunk],
    places: list[Place],
    backend: Backend,
    on_bytes: Callable[[int], None] | None,
    *,
    workers: int | None = None,
    piece: int = PIECE,
    digester: Digester | None = None,
) -> list[TensorEntry]:
    """Fill the pool's chunks from the checkpoint on `workers` threads (default WORKERS);
    the entries in plan order. `piece`: bytes per pread, per host-to-device copy; a
    multiple of the digest's piece."""
    workers = workers or WORKERS

    per_plan: list[list[Place]] = []
    it = iter(places)
    for sp in plans:
        per_plan.append([next(it) for _ in sp.outputs])
    fds = {p: os.open(p, os.O_RDONLY | os.O_CLOEXEC) for p in {sp.info.path for sp in plans}}
    if digester is not None and piece % PIECE:
        raise CheckpointError(f"piece {piece} must be a multiple of the digest's {PIECE} bytes")
    t0 = time.perf_counter()
    gpu_digest = digester is not None and gpu_hashing(torch.device(opts.device))
    job = _Job(opts, chunks, fds, piece, digester, gpu_digest)
    hashing = _Hashing(job, backend, chunks)
    t1 = time.perf_counter()
    try:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="holdfast-load") as ex:
            futures = [ex.submit(job.run, sp, pl) for sp, pl in zip(plans, per_plan, strict=True)]
            for sp, pl, fut in zip(plans, per_plan, futures, strict=True):
                hashing.add(sp, pl, fut.result())
                reader.bytes_read += sp.info.nbytes
                if on_bytes:
                    on_bytes(sp.info.nbytes)
            t2 = time.perf_counter()
            sums = hashing.finish()
    finally:
        hashing.close()
        for fd in fds.values():
            os.close(fd)
    log.info(
        "pool filled",
        readers=workers,
        setup_s=round(t1 - t0, 3),
        copy_s=round(t2 - t1, 3),
        hash_after_copy_s=round(time.perf_counter() - t2, 3),
        digest_s=round(hashing.digest_s, 3),
        checksum_s=round(hashing.checksum_s, 3),
    )
    specs = [o for sp in plans for o in sp.outputs]
    return [
        TensorEntry(
            name=spec.name,
            chunk=place[0],
            offset=place[1],
            dtype=spec.dtype,
            shape=spec.shape,
            stride=contiguous_stride(spec.shape),
            nbytes=place[2],
            checksum=checksum,
        )
        for spec, place, checksum in zip(specs, places, sums, strict=True)
    ]


_gpu_hashing: dict[torch.device, bool] = {}


def prewarm(device: torch.device, workers: int | None = None, piece: int = PIECE) -> None:
    """What a first load in this process would pay before its first byte, paid now (a
    parked daemon, before its claim): the GPU digest's kernels compiled and checked
    (`gpu_hashing`), the checksum's kernels run, and every reader's pinned staging
    buffers allocated and freed, which torch's pinned-memory cache keeps for the load
    (pinning 2 GiB of host memory is most of a second)."""
    gpu_hashing(device)
    gpu_checksums([torch.zeros(1 << 20, dtype=torch.uint8, device=device)])
    bufs = [
        torch.empty(piece, dtype=torch.uint8, pin_memory=True)
        for _ in range(2 * (workers or WORKERS))
    ]
    del bufs
    torch.cuda.synchronize(device)


def gpu_hashing(device: torch.device) -> bool:
    """Whether the digest is hashed on `device` (blake3_gpu needs Triton, which CUDA builds
    of torch bring, and its digests must equal the CPU's there: blake3_gpu.disagrees, asked
    once per device); else each reader hashes what it reads."""
    if device not in _gpu_hashing:
        try:
            import cachedaemon.blake3_gpu as blake3_gpu
        except ImportError:
            _gpu_hashing[device] = False
        else:
            why = blake3_gpu.disagrees(device)
            if why is not None:
                log.warning(
                    "the GPU's BLAKE3 is not used: the readers hash", device=str(device), why=why
                )
            _gpu_hashing[device] = why is None
    return _gpu_hashing[device]


def digest_in_pool(
    digester: Digester,
    plans: list[SourcePlan],
    per_plan: list[list[Place]],
    chunks: Sequence[OwnedChunk],
) -> None:
    """The digest's pieces of every tensor copied into the pool as the file holds it,
    hashed there on the GPU (blake3_gpu: the same BLAKE3 as the CPU's), one batch per pool
    chunk; the rest were hashed as they were read."""
    import cachedaemon.blake3_gpu as blake3_gpu

    ranges: dict[int, list[tuple[int, int]]] = {}
    keys: dict[int, list[tuple[TensorInfo, int]]] = {}
    for sp, places in zip(plans, per_plan, strict=True):
        if _needs_transform(sp):
            continue
        chunk, offset, _ = places[0]
        for k, start in enumerate(range(0, sp.info.nbytes, PIECE)):
            ranges.setdefault(chunk, []).append(
                (offset + start, min(PIECE, sp.info.nbytes - start))
            )
            keys.setdefault(chunk, []).append((sp.info, k))
    for chunk, rs in ranges.items():
        for (info, k), digest in zip(
            keys[chunk], blake3_gpu.digests(chunks[chunk].tensor, rs), strict=True
        ):
            digester.put(info, k, digest)
