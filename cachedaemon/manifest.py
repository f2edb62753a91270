"""The pool's manifest: where every tensor lives in which chunk, and its checksum; and
the content digest of the checkpoint files it was loaded from (kept in escrow with it)."""

from __future__ import annotations

import msgspec

from cachedaemon.digest import FileDigest


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
    files: tuple[FileDigest, ...] = ()  # `cachedaemon.digest` of the checkpoint, at load

    @property
    def pool_bytes(self) -> int:
        return sum(c.size for c in self.chunks)
