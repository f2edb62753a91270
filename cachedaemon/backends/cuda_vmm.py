"""GPU backend: each chunk is one cuMemCreate allocation shared as a POSIX fd.

The creator maps its chunk read-write, fills it, then seals it (the mapping becomes
PROT_READ). Any process given the fd imports it, maps it PROT_READ on the same device and
sees it as a flat CUDA uint8 tensor with no copy. Physical memory lives as long as any fd,
handle or mapping of it does, in any process: the creator may die and the weights stay.

A mapping is unmapped when the last tensor viewing it is gone (or at exit), after the
device has finished queued work, so closing a chunk never pulls memory from under a view.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import structlog
import torch

import cachedaemon.cuda_driver as drv
from cachedaemon.backends.base import Backend, Mapping, OwnedChunk
from cachedaemon.cuda_checksum import ALGO, gpu_checksum, gpu_checksums
from cachedaemon.errors import CacheError
from cachedaemon.pool_plan import GEOMETRY

log = structlog.get_logger("cachedaemon.cuda_vmm")


class _Region(drv.DeviceBytes):
    """One mapped virtual range, as torch takes it (`drv.DeviceBytes`).

    Tensors made from it hold a reference to it; when the last one goes, the finalizer
    unmaps the range (the physical memory goes when no fd, handle or mapping is left)."""

    def __init__(self, ctx: Any, ptr: int, size: int, readonly: bool) -> None:
        super().__init__(ptr, size)
        self.readonly = readonly
        self._finalizer = weakref.finalize(self, drv.unmap, ctx, ptr, size)


class _Mapped(Mapping):
    def __init__(self, region: _Region, device: torch.device) -> None:
        self.size = region.size
        self._tensor: torch.Tensor | None = torch.as_tensor(region, device=device)

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            raise ValueError("mapping is closed")
        return self._tensor

    def close(self) -> None:
        self._tensor = None  # the range is unmapped once the views held elsewhere go too


class CudaVmmMapping(_Mapped):
    """A chunk received as an fd, mapped read-only."""


class CudaVmmChunk(_Mapped, OwnedChunk):
    """A chunk this process created: read-write until `seal`, then read-only."""

    def __init__(self, backend: CudaVmmBackend, size: int) -> None:
        self._backend = backend
        self._handle: Any = drv.create(backend.ordinal, size)
        try:
            self.fd = drv.export_fd(self._handle)
            ptr = drv.map_handle(backend.ordinal, self._handle, size, backend.granularity, True)
        except CacheError:
            drv.release(self._handle)
            raise
        self._ptr = ptr
        super().__init__(_Region(backend.ctx, ptr, size, readonly=False), backend.device)
        self.sealed = False

    def seal(self) -> None:
        """Finish queued writes, then drop write access to this process's mapping."""
        if self.sealed:
            return
        self._backend.make_current()
        torch.cuda.synchronize(self._backend.device)
        try:
            drv.set_access(self._backend.ordinal, self._ptr, self.size, writable=False)
        except drv.CudaDriverError as exc:
            log.warning("seal_kept_writable", size=self.size, error=str(exc))
        self.sealed = True

    def close(self) -> None:
        super().close()
        if self._handle is not None:
            self._backend.make_current()
            drv.release(self._handle)
            self._handle = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class CudaVmmBackend(Backend):
    """Pool chunks in GPU memory of `device` ("cuda:N"), shared as POSIX fds."""

    name = "cuda-vmm"
    checksum_algo = ALGO
    # 4 GiB: a 16 GB pool is 4 imports, ~2 ms to attach on an H200
    max_chunk_bytes = GEOMETRY["cuda-vmm"].max_chunk_bytes

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise CacheError(f"backend cuda-vmm serves cuda:N devices, not {device!r}")
        if not torch.cuda.is_available():
            raise CacheError(f"--device {device} asked for, but torch sees no CUDA device")
        self.ordinal = self.device.index or 0
        torch.empty(0, device=self.device)  # the primary context, as torch makes it
        self.ctx = drv.primary_context(self.ordinal)
        self.granularity = drv.granularity(self.ordinal)

    def make_current(self) -> None:
        """Driver calls may come from any thread: bind the device's primary context."""
        drv.set_current(self.ctx)

    def create(self, size: int) -> CudaVmmChunk:
        self.make_current()
        return CudaVmmChunk(self, self.round_size(size))

    def open(self, fd: int, size: int) -> CudaVmmMapping:
        self.make_current()
        handle = drv.import_fd(fd)
        try:
            ptr = drv.map_handle(self.ordinal, handle, size, self.granularity, False)
        except drv.CudaDriverError as exc:
            raise CacheError(
                f"cannot map pool chunk fd {fd} ({size} bytes per the manifest) on "
                f"{self.device}: {exc}; the daemon serves another device or the fd is stale"
            ) from exc
        finally:
            drv.release(handle)  # the mapping keeps the memory alive from here on
        return CudaVmmMapping(_Region(self.ctx, ptr, size, readonly=True), self.device)

    def round_size(self, size: int) -> int:
        g = self.granularity
        return max(g, -(-size // g) * g)

    def checksum(self, data: torch.Tensor) -> str:
        return gpu_checksum(data)

    def checksums(self, data: list[torch.Tensor]) -> list[str]:
        """Checksums of many tensors with one device sync (3000 tensors: one wait, not 3000)."""
        self.make_current()
        return gpu_checksums(data)
