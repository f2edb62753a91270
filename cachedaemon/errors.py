"""One root exception for the weight cache; every failure a user can act on is one of these.

A bad frame on the daemon's or the keeper's socket is the wire's
`holdfast_contract.errors.ProtocolError`, shared by every holdfast socket."""

from __future__ import annotations

from holdfast_contract.errors import HoldfastError


class CacheError(HoldfastError):
    """Root of the weight cache's errors."""


class CheckpointError(CacheError):
    """The checkpoint dir cannot be read as asked (missing, truncated, bad header, dtype)."""


class ShardingError(CacheError):
    """A tensor cannot be split for the requested tensor-parallel size."""


class QuantizationError(CacheError):
    """An unknown post-load transform, or one that does not apply."""


class CacheMismatch(CacheError):
    """The daemon serves a pool built for another CacheConfig. `files` names each
    checkpoint file that differs and how; `stat_only` is true when only the files' stat
    facts differ and no content was compared (a copy of the same bytes would show so)."""

    def __init__(
        self,
        fields: list[str],
        message: str | None = None,
        files: list[str] | None = None,
        stat_only: bool = False,
    ) -> None:
        self.fields = list(fields)
        self.files = list(files or [])
        self.stat_only = stat_only
        super().__init__(
            message
            or "the daemon's pool was built for another config; fields that differ: "
            + ", ".join(self.fields)
        )


class DaemonUnavailable(CacheError):
    """No daemon answers on the socket."""


class SocketDirError(CacheError):
    """A daemon or keeper cannot serve its socket from the runtime dir: the dir cannot be
    created, is another user's or not writable, or a live process serves that socket already.
    (The supervisor's RuntimeDirError is about holding the whole dir.)"""


class ChecksumError(CacheError):
    """Pool bytes do not match the manifest's checksums."""
