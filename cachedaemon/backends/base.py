"""The backend interface shared by memfd (CPU) and cuda-vmm (GPU)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from cachedaemon.pool_plan import GEOMETRY

if TYPE_CHECKING:
    import torch


class Mapping(ABC):
    """A chunk mapped into this process. `tensor` is a flat uint8 tensor over the chunk."""

    size: int

    @property
    @abstractmethod
    def tensor(self) -> torch.Tensor: ...

    @abstractmethod
    def close(self) -> None:
        """Drop this process's mapping (tensors viewing it must be gone first)."""


class OwnedChunk(Mapping):
    """A chunk this process created: writable until `seal`, then read-only; owns its fd."""

    fd: int

    @abstractmethod
    def seal(self) -> None:
        """Make the chunk immutable for everyone from now on (as far as the backend can)."""


class Backend(ABC):
    name: str
    # tensor offsets inside a chunk, and the largest chunk (cachedaemon/pool_plan.py)
    alignment: int = GEOMETRY["memfd"].alignment
    max_chunk_bytes: int = GEOMETRY["memfd"].max_chunk_bytes

    @abstractmethod
    def create(self, size: int) -> OwnedChunk:
        """A new writable chunk of at least `size` bytes."""

    @abstractmethod
    def open(self, fd: int, size: int) -> Mapping:
        """Map a chunk received as `fd`, read-only. Does not take ownership of `fd`."""

    @abstractmethod
    def round_size(self, size: int) -> int:
        """The size an allocation of `size` bytes really takes."""

    @abstractmethod
    def checksum(self, data: torch.Tensor) -> str:
        """A checksum of a flat uint8 tensor's bytes, computed where the bytes live."""

    def checksum_region(self, chunk: Mapping, offset: int, nbytes: int) -> str:
        """The checksum of `nbytes` at `offset` of a mapped chunk."""
        return self.checksum(chunk.tensor[offset : offset + nbytes])

    def checksums(self, data: list[torch.Tensor]) -> list[str]:
        """Checksums of many tensors; backends override this to batch the work."""
        return [self.checksum(d) for d in data]

    checksum_algo: str = ""
