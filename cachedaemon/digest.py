"""The content digest of a checkpoint: what a pool was made of, byte for byte.

A file's digest is the BLAKE3 of its parts' BLAKE3s: the header (8-byte length + JSON),
then every tensor's bytes in file order, in pieces of PIECE bytes from the tensor's start.
BLAKE3 (a cryptographic hash, about 5 GB/s a core with SIMD, against sha256's 1-2 GB/s)
keeps the digest's CPU a small share of a load's. Pieces let many threads hash one file
(blake3 lets go of the GIL while it hashes), and
let the daemon hash each piece as it reads it: the load reads every byte anyway, so the
digest costs CPU on other threads, not another read. config.json is hashed whole. Bytes
that no tensor covers (padding) are not in the digest: no weight is made of them.

`Digester` is the load's side: `add` hashes what `CheckpointReader.read_into` read on
digest threads of its own; `read` reads and hashes on the caller's thread (a GPU reader of
a tensor it transforms); `put` records a piece hashed elsewhere (the GPU load hashes what
it copied into the pool: cachedaemon.blake3_gpu);
`digest_dir` reads a dir's files for `cachedaemon verify` and `verify: content`.
Imports no torch.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import msgspec
from blake3 import blake3

from cachedaemon.checkpoint import CheckpointReader, TensorInfo
from cachedaemon.errors import CheckpointError

PIECE = 64 << 20
ALGO = "blake3 of blake3(header), blake3(each 64 MiB piece of each tensor, file order)"
# add's threads (a CPU pool's load, digest_dir): every core. The GPU load hashes on its
# readers instead (read)
WORKERS = max(2, min(32, os.cpu_count() or 2))
HELD = 512 << 20  # bytes waiting to be hashed, at most (one piece more when it is larger)
# Digester.read's slice: read, then hashed by the thread that read it while it is still in
# that core's cache. On an H100 host this was no faster than add's threads hashing whole
# pieces (the load with the digest took 1.38x as long as without, 1.27x with add's threads:
# bench/results/load_digest); what the load waits for is not pinned down
SLICE = 1 << 20


class FileDigest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    size: int
    blake3: str  # hex; ALGO says of what


def differences(mine: Sequence[FileDigest], theirs: Sequence[FileDigest]) -> list[str]:
    """One line per file whose content differs between two digests ("" when none do)."""
    a, b = {f.name: f for f in mine}, {f.name: f for f in theirs}
    out = []
    for name in sorted(a.keys() | b.keys()):
        x, y = a.get(name), b.get(name)
        if x is None or y is None:
            out.append(f"{name}: only in {'the pool' if x is None else 'this dir'}")
        elif x.size != y.size:
            out.append(f"{name}: {x.size} bytes here, {y.size} in the pool")
        elif x.blake3 != y.blake3:
            out.append(f"{name}: content differs (blake3 {x.blake3[:12]} here, {y.blake3[:12]})")
    return out


def _pieces(info: TensorInfo, offset: int, data: memoryview) -> Iterable[tuple[int, memoryview]]:
    if offset % PIECE:
        raise CheckpointError(f"{info.path}: digest piece of {info.name!r} at {offset} unaligned")
    for k in range(0, len(data), PIECE):
        yield (offset + k) // PIECE, data[k : k + PIECE]


class Digester:
    """The digests of a checkpoint's files, from the tensor bytes the load reads."""

    def __init__(self, config: Path, files: Sequence[Path], tensors: Iterable[TensorInfo]) -> None:
        self.config = config
        self.files = list(files)
        self.tensors = sorted(tensors, key=lambda i: (i.path, i.start))
        self._sums: dict[tuple[str, int, int], bytes] = {}
        self._futures: list[Future[None]] = []
        self._held = 0  # bytes handed to the digest threads and not hashed yet
        self._room = threading.Condition()
        self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="holdfast-digest")

    def add(self, info: TensorInfo, data: memoryview, offset: int = 0) -> list[Future[None]]:
        """Hash `data` (the tensor's bytes from `offset`) on the digest threads; the
        buffer must stay as it is until the futures returned are done (a read into the
        pool stays; a staging buffer waits for them before it is reused)."""
        out = []
        for k, piece in _pieces(info, offset, data):
            n = len(piece)
            self._reserve(n)  # a reader far ahead of the digest threads waits for them
            out.append(self._pool.submit(self._hash, info, k, piece))
        self._futures += out
        return out

    def read(
        self,
        info: TensorInfo,
        buf: memoryview,
        offset: int,
        read_into: Callable[[memoryview, int], None],
    ) -> None:
        """Fill `buf` with the tensor's bytes from `offset` by `read_into(view, offset)`, a
        SLICE at a time, and hash each slice on this thread right after it is read, while
        it is in this core's cache. Recorded as add's pieces are; `offset` on a piece's
        boundary, as for add."""
        for k, piece in _pieces(info, offset, buf):
            start = k * PIECE
            hasher = blake3(max_threads=1)
            for s in range(0, len(piece), SLICE):
                part = piece[s : s + SLICE]
                read_into(part, start + s)
                hasher.update(part)
            self._sums[(info.path, info.start, k)] = hasher.digest()

    def put(self, info: TensorInfo, k: int, digest: bytes) -> None:
        """Record piece `k` of the tensor, hashed elsewhere (on the GPU: blake3_gpu) as
        add and read hash it."""
        self._sums[(info.path, info.start, k)] = digest

    def _reserve(self, n: int) -> None:
        with self._room:
            self._room.wait_for(lambda: self._held == 0 or self._held + n <= HELD)
            self._held += n

    def _release(self, n: int) -> None:
        with self._room:
            self._held -= n
            self._room.notify_all()

    def _hash(self, info: TensorInfo, k: int, piece: memoryview) -> None:
        try:
            self._sums[(info.path, info.start, k)] = blake3(piece, max_threads=1).digest()
        finally:
            self._release(len(piece))

    def result(self) -> tuple[FileDigest, ...]:
        """Every file's digest; CheckpointError when a tensor was not read whole."""
        try:
            for fut in self._futures:
                fut.result()
        finally:
            self._pool.shutdown()
        by_file: dict[str, list[bytes]] = {str(p): [] for p in self.files}
        for info in self.tensors:
            for k in range(-(-info.nbytes // PIECE)):
                part = self._sums.get((info.path, info.start, k))
                if part is None:
                    raise CheckpointError(f"{info.path}: tensor {info.name!r} was not read whole")
                by_file[info.path].append(part)
        return (
            _whole(self.config),
            *(_file_digest(Path(p), parts) for p, parts in by_file.items()),
        )

    def close(self) -> None:
        self._pool.shutdown(cancel_futures=True)


def _whole(path: Path) -> FileDigest:
    data = path.read_bytes()
    return FileDigest(path.name, len(data), blake3(data).hexdigest())


def _file_digest(path: Path, parts: list[bytes]) -> FileDigest:
    with path.open("rb") as f:
        head = f.read(8)
        header = head + f.read(int.from_bytes(head, "little"))
        size = os.fstat(f.fileno()).st_size
    top = blake3(blake3(header).digest())
    for part in parts:
        top.update(part)
    return FileDigest(path.name, size, top.hexdigest())


def digest_dir(model_dir: str | Path) -> tuple[FileDigest, ...]:
    """The digest of a checkpoint dir's files, read here (every byte, on WORKERS threads)."""
    with CheckpointReader(model_dir) as reader:
        digester = Digester(reader.model_dir / "config.json", reader.files, reader.tensors.values())
        maps = {}
        try:
            for path in reader.files:
                with path.open("rb") as f:
                    if os.fstat(f.fileno()).st_size:
                        maps[str(path)] = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
            for info in reader.tensors.values():
                view = memoryview(maps[info.path])[info.start : info.start + info.nbytes]
                digester.add(info, view)
            del view
            return digester.result()
        finally:
            digester.close()
            for m in maps.values():
                with contextlib.suppress(BufferError):  # a view held by a failed hash: gc unmaps
                    m.close()
