"""Engine side of a refit: another pool of the same layout, mapped at the addresses of the
pool an engine maps now, so every view of it (and every CUDA graph captured over them)
reads the new weights without a pointer changing.

`fetch` asks the new pool's daemon for its manifest and fds and checks, before anything
changes, that each of its tensors sits where the engine's tensor of that name sits now,
with the same dtype, shape and strides, and that each chunk is the size of the mapping it
replaces. `Refit.swap` then maps every chunk over the old one: on the CPU one mmap
MAP_FIXED each (the old pages are replaced in one call, never unmapped first); on a GPU
cuMemUnmap and cuMemMap into the same reserved range, with the device idle. The old pool's
memory goes when no process maps it any more."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import time
from collections import defaultdict
from pathlib import Path

import torch

from cachedaemon import protocol
from cachedaemon.config import CacheConfig
from cachedaemon.errors import CacheError
from cachedaemon.manifest import Manifest
from holdfast_contract import wire
from holdfast_contract.errors import ProtocolError

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_MAP_FIXED = 0x10


class Refit:
    """A new pool's fds and where each chunk goes; `swap` maps them, `close` gives them
    back unused."""

    def __init__(
        self, manifest: Manifest, fds: list[int], bases: list[int], inodes: list[int]
    ) -> None:
        self.manifest, self.fds, self.bases = manifest, fds, bases
        self.inodes = inodes  # each old chunk's memfd inode (0 on a GPU)
        self.swap_ms = 0.0

    @property
    def fingerprint(self) -> str:
        return self.manifest.fingerprint

    def swap(self) -> None:
        """Map every chunk of the new pool over the old one. Call between steps, with
        nothing queued on the device that reads the weights."""
        t0 = time.perf_counter()
        try:
            if self.manifest.backend == "memfd":
                chunks = zip(self.fds, self.bases, self.inodes, self.manifest.chunks, strict=True)
                for fd, base, inode, c in chunks:
                    _map_fixed(base, c.size, fd)
                    _repoint(inode, fd)
            else:
                _swap_cuda(self.manifest, self.fds, self.bases)
        finally:
            self.close()
        self.swap_ms = (time.perf_counter() - t0) * 1e3

    def close(self) -> None:
        fds, self.fds = self.fds, []
        wire.close_fds(fds)


def fetch(
    socket_path: str | Path,
    config: CacheConfig | None,
    current: dict[str, torch.Tensor],
    *,
    timeout: float = 10.0,
) -> Refit:
    """The pool at `socket_path`, ready to be swapped in for the one `current` (the
    engine's tensors by name) are views of. Raises CacheError, naming the first tensor or
    chunk that differs, when it cannot take the old pool's place."""
    try:
        reply, fds = protocol.call(
            str(socket_path), protocol.AttachRequest(config), max_fds=wire.MAX_FDS, timeout=timeout
        )
    except (ProtocolError, OSError) as e:  # (DaemonUnavailable is a CacheError: it passes)
        raise CacheError(f"daemon at {socket_path}: {e}") from e
    if not isinstance(reply, protocol.AttachReply):
        wire.close_fds(fds)
        detail = (
            reply.message
            if isinstance(reply, protocol.ErrorReply)
            else f"fields {reply.fields} differ"
            if isinstance(reply, protocol.Mismatch)
            else type(reply).__name__
        )
        raise CacheError(f"daemon at {socket_path} refused the refit's attach: {detail}")
    manifest = reply.manifest
    try:
        if len(fds) != len(manifest.chunks):
            raise CacheError(f"daemon sent {len(fds)} fds for {len(manifest.chunks)} chunks")
        bases, inodes = place(manifest, current)
    except CacheError:
        wire.close_fds(fds)
        raise
    return Refit(manifest, fds, bases, inodes)


def place(manifest: Manifest, current: dict[str, torch.Tensor]) -> tuple[list[int], list[int]]:
    """Each chunk's address (where the engine's tensors of the names it holds sit now),
    and the inode of the memfd mapped there now (0 on a GPU)."""
    from cachedaemon.loader import dtype_of

    seen: dict[int, set[int]] = defaultdict(set)
    for e in manifest.tensors:
        now = current.get(e.name)
        if now is None:
            raise CacheError(f"the new pool holds {e.name}, which this engine does not map")
        if (now.dtype, tuple(now.shape), tuple(now.stride())) != (
            dtype_of(e.dtype),
            e.shape,
            e.stride,
        ):
            raise CacheError(
                f"{e.name}: the new pool holds {e.dtype} {list(e.shape)} strides "
                f"{list(e.stride)}, this engine maps {now.dtype} {list(now.shape)} strides "
                f"{list(now.stride())}; a refit takes weights of the same names and shapes"
            )
        seen[e.chunk].add(now.data_ptr() - e.offset)
    bases, inodes = [], []
    for i, chunk in enumerate(manifest.chunks):
        found = seen.get(i, set())
        if len(found) != 1:
            raise CacheError(
                f"chunk {i} of the new pool lays its tensors out otherwise than the pool this "
                "engine maps (they do not sit at one offset from each other); a refit needs "
                "the same layout: the same checkpoint names, shapes and dtype"
            )
        base = found.pop()
        size, inode = _mapped(manifest, base)
        if size != chunk.size:
            raise CacheError(
                f"chunk {i} of the new pool is {chunk.size} bytes, the mapping it would "
                f"replace {size}; a refit needs the same layout"
            )
        bases.append(base)
        inodes.append(inode)
    names = {e.name for e in manifest.tensors}
    spans = [(b, b + c.size) for b, c in zip(bases, manifest.chunks, strict=True)]
    missing = sorted(  # views of the pool mapped now that the new one would not replace
        n
        for n, t in current.items()
        if n not in names and any(lo <= t.data_ptr() < hi for lo, hi in spans)
    )
    if missing:
        raise CacheError(f"the new pool lacks {missing[:3]} ({len(missing)} tensors)")
    return bases, inodes


def _mapped(manifest: Manifest, base: int) -> tuple[int, int]:
    """The size of the mapping that starts at `base` (0: none starts there), and on the
    CPU the inode of the file it maps."""
    if manifest.backend == "memfd":
        for line in Path("/proc/self/maps").read_text().splitlines():
            span, _perms, _offset, _dev, inode, *_ = line.split()
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo == base:
                return hi - lo, int(inode)
        return 0, 0
    from cachedaemon import cuda_driver as drv

    # a worker thread (the engine fetches off its event loop) has no CUDA context yet: a
    # runtime call on the device binds its primary one, which the driver call below needs
    torch.cuda.synchronize(torch.device(manifest.device))
    start, size = drv.address_range(base)
    return (size if start == base else 0), 0


def _repoint(inode: int, fd: int) -> None:
    """Point every fd of this process on the old memfd (`inode`) at the new one: Python's
    mmap keeps a duplicate of the fd it mapped, which would hold the old pool's memory for
    the life of the engine. dup2 replaces it in one step, so the mmap object's fd names
    the memfd mapped at its address again and the old one is released."""
    for name in os.listdir("/proc/self/fd"):
        n = int(name)
        if n == fd:
            continue
        try:
            st = os.fstat(n)
            target = os.readlink(f"/proc/self/fd/{n}")
        except OSError:  # (the listing's own fd, or one closed meanwhile)
            continue
        if st.st_ino == inode and target.startswith("/memfd:"):
            os.dup2(fd, n, inheritable=False)


def _map_fixed(base: int, size: int, fd: int) -> None:
    got = _libc.mmap(base, size, mmap.PROT_READ, mmap.MAP_SHARED | _MAP_FIXED, fd, 0)
    if got != base:
        err = ctypes.get_errno()
        raise CacheError(f"mmap of a refit chunk at {base:#x} failed: {os.strerror(err)}")


def _swap_cuda(manifest: Manifest, fds: list[int], bases: list[int]) -> None:
    from cachedaemon import cuda_driver as drv

    device = torch.device(manifest.device)
    torch.cuda.synchronize(device)
    for fd, base, c in zip(fds, bases, manifest.chunks, strict=True):
        drv.remap(device.index or 0, base, c.size, fd)
