"""The fleet's errors: one root (`FleetError`), each message naming what to change."""

from __future__ import annotations

from supervisor.errors import SupervisorError


class FleetError(SupervisorError):
    """Root of the fleet's errors."""


class JoinRefused(FleetError):
    """This node may not join its cluster as configured; it does not retry."""


class DuplicateNode(JoinRefused):
    """Another live supervisor holds this node name."""


class FingerprintMismatch(JoinRefused):
    """The cluster serves another model."""


class EtcdError(FleetError):
    """etcd answered with an error; `code` is its gRPC status code."""

    def __init__(self, message: str, code: int = 0) -> None:
        self.code = code
        super().__init__(message)


class EtcdUnavailable(EtcdError):
    """No endpoint answered within the request's deadline."""


class LeaseLost(EtcdError):
    """The lease expired or was revoked: keys attached to it are gone."""


class LeaseStale(LeaseLost):
    """No renewal of the lease came through for its TTL, while etcd did not answer: it may
    have expired, or etcd (electing a new raft leader) may have kept it alive."""
