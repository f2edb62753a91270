"""The policy's `cluster:` section: which etcd, which cluster, this node's name and priority.

Absent, the supervisor runs alone as before. `parse_cluster(data, miss_window_s)` returns a
frozen `ClusterSpec` or raises `PolicyError` with one `$.cluster.<key>: ...` line per
problem. The lease timing derived from `ttl_s` (renewal interval, step-down margin) is
defined here and nowhere else. It belongs to the policy schema (`supervisor/policy.py`
reads it), so it lives beside it, below `supervisor/fleet/`, which imports it.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from supervisor.errors import PolicyError

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
ENDPOINT = re.compile(r"(https?://)?[A-Za-z0-9_.:\[\]-]+:\d{1,5}")


class ClusterSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str  # the cluster: every node serving the same model joins the same name
    etcd: list[str]  # endpoints, HOST:PORT or http://HOST:PORT
    node: str  # this node's name, unique in the cluster
    ttl_s: int = 2  # the leader lease, whole seconds as etcd grants them
    priority: int = 0  # higher runs: a healthy node of higher priority is handed leadership
    prefix: str = "holdfast"  # keys live under /<prefix>/<name>/
    # HOST:PORT the other nodes reach this node's router at; "" in a policy file means
    # router.listen (the policy loader fills it in and refuses 0.0.0.0)
    advertise: str = ""

    @property
    def renew_s(self) -> float:
        """How often the lease is renewed: four times per TTL."""
        return self.ttl_s / 4

    @property
    def margin_s(self) -> float:
        """A leader stops serving this long before its lease could expire in etcd."""
        return self.ttl_s / 4

    @property
    def lease_poll_s(self) -> float:
        """How often a follower reads the leader's lease TTL (see fleet.decide.early_revoke)."""
        return self.ttl_s / 20

    @property
    def hold_s(self) -> float:
        """How long after its last successful renewal a leader may still serve."""
        return self.ttl_s - self.margin_s

    @property
    def root(self) -> str:
        return f"/{self.prefix}/{self.name}/"

    @property
    def leader_key(self) -> str:
        return self.root + "leader"

    @property
    def fingerprint_key(self) -> str:
        return self.root + "fingerprint"

    @property
    def nodes_prefix(self) -> str:
        return self.root + "nodes/"

    def node_key(self, node: str) -> str:
        return self.nodes_prefix + node


def parse_cluster(data: Any, miss_window_s: float) -> ClusterSpec | None:
    """The `cluster:` mapping of a policy (None: no cluster), checked against the
    heartbeat miss window (heartbeat.interval_ms x miss_limit, in seconds)."""
    if data is None:
        return None
    try:
        spec = msgspec.convert(data, ClusterSpec)
    except msgspec.ValidationError as exc:
        raise PolicyError([_path(str(exc))]) from exc
    errors = cluster_errors(spec, miss_window_s)
    if errors:
        raise PolicyError(errors)
    return spec


def _path(message: str) -> str:
    """msgspec's `Expected int, got str - at $.ttl_s` as `$.cluster.ttl_s: expected ...`."""
    text, sep, where = message.rpartition(" - at `")
    if not sep:
        text, where = message, "$`"
    path = "$.cluster" + where.rstrip("`")[1:]
    text = text.replace("`", "")
    return f"{path}: {text[:1].lower()}{text[1:]}"


def cluster_errors(spec: ClusterSpec, miss_window_s: float) -> list[str]:
    """Rules msgspec cannot express, each naming the key to change."""
    errors: list[str] = []
    for key in ("name", "node", "prefix"):
        value = getattr(spec, key)
        if not NAME.fullmatch(value):
            errors.append(
                f"$.cluster.{key}: {value!r} must be 1-63 letters, digits, '_', '.' or '-', "
                "starting with a letter or digit"
            )
    if not spec.etcd:
        errors.append("$.cluster.etcd: empty; list the etcd endpoints as HOST:PORT")
    for i, endpoint in enumerate(spec.etcd):
        if not ENDPOINT.fullmatch(endpoint):
            errors.append(f"$.cluster.etcd[{i}]: {endpoint!r} is not HOST:PORT or http://HOST:PORT")
    if spec.ttl_s < 1:
        errors.append(f"$.cluster.ttl_s: got {spec.ttl_s}, must be at least 1 (seconds)")
    elif spec.ttl_s <= miss_window_s:
        errors.append(
            f"$.cluster.ttl_s: {spec.ttl_s} s is not longer than the heartbeat miss window "
            f"({miss_window_s:g} s = heartbeat.interval_ms x heartbeat.miss_limit): a node "
            "would lose leadership before it notices its own primary is gone; raise "
            "cluster.ttl_s or shorten the heartbeat window"
        )
    if spec.advertise:
        errors += advertise_errors(spec.advertise)
    return errors


def advertise_errors(advertise: str, source: str = "") -> list[str]:
    """`advertise` must be an address another machine can connect to."""
    host, sep, port = advertise.rpartition(":")
    where = f" (from {source})" if source else ""
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return [f"$.cluster.advertise: {advertise!r}{where} is not HOST:PORT"]
    if host.strip("[]") in ("0.0.0.0", "::", "*"):
        return [
            f"$.cluster.advertise: {advertise!r}{where} is a wildcard, not an address "
            "other nodes can reach; set cluster.advertise to this node's HOST:PORT "
            "(the router's port on an address the other nodes route to)"
        ]
    return []
