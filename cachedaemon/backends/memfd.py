"""CPU backend: each chunk is a memfd; the creator seals it, everyone else maps it PROT_READ."""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import warnings
import zlib
from typing import TYPE_CHECKING

from cachedaemon.backends.base import Backend, Mapping, OwnedChunk
from cachedaemon.pool_plan import GEOMETRY

if TYPE_CHECKING:  # torch is imported only when a tensor is asked for: a daemon that
    import torch  # reclaims and verifies a pool never loads it

_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL


def _tensor_over(mm: mmap.mmap) -> torch.Tensor:
    import torch

    with warnings.catch_warnings():
        # torch warns that a read-only buffer is not writable: that is the point.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mm, dtype=torch.uint8)


class MemfdMapping(Mapping):
    def __init__(self, fd: int, size: int) -> None:
        self.size = size
        self._mm: mmap.mmap | None = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        self._tensor: torch.Tensor | None = None

    @property
    def tensor(self) -> torch.Tensor:
        if self._mm is None:
            raise ValueError("mapping is closed")
        if self._tensor is None:
            self._tensor = _tensor_over(self._mm)
        return self._tensor

    def crc32(self, offset: int, nbytes: int) -> str:
        if self._mm is None:
            raise ValueError("mapping is closed")
        with memoryview(self._mm) as mv:
            return f"{zlib.crc32(mv[offset : offset + nbytes]):08x}"

    def close(self) -> None:
        self._tensor = None
        if self._mm is not None:
            with contextlib.suppress(BufferError):  # views alive: unmapped with the last one
                self._mm.close()
            self._mm = None


class MemfdChunk(OwnedChunk):
    def __init__(self, size: int) -> None:
        self.size = size
        self.fd = os.memfd_create("holdfast-pool", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self.fd, size)
        self._mm: mmap.mmap | None = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED)
        import torch

        self._tensor: torch.Tensor | None = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._sealed = False

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            raise ValueError("chunk is closed")
        return self._tensor

    def seal(self) -> None:
        """Drop the writable mapping, seal the memfd against writes and resizes, map it
        read-only again: from here on nobody, the creator included, can change it."""
        if self._sealed:
            return
        self._tensor = None
        if self._mm is not None:
            self._mm.close()
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)
        self._mm = mmap.mmap(self.fd, self.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        self._tensor = _tensor_over(self._mm)
        self._sealed = True

    def close(self) -> None:
        self._tensor = None
        if self._mm is not None:
            with contextlib.suppress(BufferError):
                self._mm.close()
            self._mm = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class MemfdBackend(Backend):
    name = "memfd"
    checksum_algo = "crc32"

    def create(self, size: int) -> MemfdChunk:
        return MemfdChunk(self.round_size(size))

    def open(self, fd: int, size: int) -> MemfdMapping:
        actual = os.fstat(fd).st_size
        if actual < size:
            from cachedaemon.errors import CacheError

            raise CacheError(f"pool chunk fd holds {actual} bytes; the manifest says {size}")
        return MemfdMapping(fd, size)

    def round_size(self, size: int) -> int:
        return GEOMETRY["memfd"].round_size(size)

    def checksum(self, data: torch.Tensor) -> str:
        return f"{zlib.crc32(data.numpy().data):08x}"

    def checksum_region(self, chunk: Mapping, offset: int, nbytes: int) -> str:
        if isinstance(chunk, MemfdMapping):
            return chunk.crc32(offset, nbytes)
        return super().checksum_region(chunk, offset, nbytes)
