"""Pool backends: where the pool's chunks live and how they travel as fds.

Every backend has the same semantics: a chunk is one allocation backed by a file
descriptor; the creator fills it through a writable mapping, then seals it; any process
given the fd maps it read-only; the memory lives as long as any fd or mapping does.
"""

from __future__ import annotations

from cachedaemon.backends.base import Backend, Mapping, OwnedChunk
from cachedaemon.errors import CacheError


def get_backend(name: str, device: str) -> Backend:
    if name == "memfd":
        from cachedaemon.backends.memfd import MemfdBackend

        return MemfdBackend()
    if name == "cuda-vmm":
        from cachedaemon.backends.cuda_vmm import CudaVmmBackend

        return CudaVmmBackend(device)
    raise CacheError(f"unknown backend {name!r}; choose memfd or cuda-vmm")


__all__ = ["Backend", "Mapping", "OwnedChunk", "get_backend"]
