"""The GPU load path: parallel readers into pinned staging buffers, async copies to the GPU,
transforms (dtype, TP shard, fp8-block) on the GPU, one batched checksum at the end.

`fill_parallel` has the signature of `cachedaemon.pool._fill`, so `build_pool` can use it
for cuda-vmm pools. Each worker thread owns a CUDA stream and two pinned buffers: it
preads piece k+1 while piece k is copied to the device. A tensor that needs no transform
is copied straight into its place in the pool; one that does lands in a GPU scratch
tensor first and is transformed there, by the same `loader.transform` the CPU path uses.

The content digest (cachedaemon.digest) of a tensor copied as the file holds it is hashed
in the pool, on the GPU, once every copy is in (`digest_in_pool`, cachedaemon.blake3_gpu:
the same BLAKE3 as the CPU's); hashed on the host beside the reads, it made an H100's
load of llama-8b 1.3x as long. A transformed tensor's bytes are hashed by its reader,
slice by slice right after each pread (`Digester.read`), as is every tensor where Triton
is missing.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

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
    t1 = time.perf_counter()
    try:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="holdfast-load") as ex:
            futures = [ex.submit(job.run, sp, pl) for sp, pl in zip(plans, per_plan, strict=True)]
            regions: list[torch.Tensor] = []
            for sp, fut in zip(plans, futures, strict=True):
                regions += fut.result()
                reader.bytes_read += sp.info.nbytes
                if on_bytes:
                    on_bytes(sp.info.nbytes)
    finally:
        for fd in fds.values():
            os.close(fd)
    t2 = time.perf_counter()
    if digester is not None and gpu_digest:
        digest_in_pool(digester, plans, per_plan, chunks)
    t3 = time.perf_counter()
    if backend.checksum_algo == ALGO:
        sums = gpu_checksums(regions)  # one device sync for the whole pool
    else:
        sums = [backend.checksum(r) for r in regions]
    log.info(
        "pool filled",
        readers=workers,
        setup_s=round(t1 - t0, 3),
        copy_s=round(t2 - t1, 3),
        digest_s=round(t3 - t2, 3),
        checksum_s=round(time.perf_counter() - t3, 3),
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
