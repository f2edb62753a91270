"""The pool's manifest: where every tensor lives in which chunk, and its checksum."""

from __future__ import annotations

import msgspec


class TensorEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    chunk: int
    offset: int
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    nbytes: int
    checksum: str


class ChunkEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    size: int  # bytes of the allocation (backend-rounded)
    used: int  # bytes holding tensors


class Manifest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    fingerprint: str
    backend: str
    device: str
    checksum_algo: str
    chunks: tuple[ChunkEntry, ...]
    tensors: tuple[TensorEntry, ...]

    @property
    def pool_bytes(self) -> int:
        return sum(c.size for c in self.chunks)
