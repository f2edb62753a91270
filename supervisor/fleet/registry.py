"""The cluster's keys in etcd: joining (fingerprint check, node-name registration) and
the view of the leader and the nodes that the watch keeps current."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec

from supervisor.fleet.decide import NodeInfo
from supervisor.fleet.errors import DuplicateNode, FingerprintMismatch
from supervisor.fleet.etcd import EtcdClient, KeyValue
from supervisor.fleet_spec import ClusterSpec


class Fingerprint(msgspec.Struct, frozen=True):
    """The value of /<prefix>/<cluster>/fingerprint: the model, and who set it first."""

    fingerprint: str
    node: str


async def check_fingerprint(etcd: EtcdClient, spec: ClusterSpec, fingerprint: str) -> None:
    """Set the cluster's fingerprint if unset; FingerprintMismatch if it is another."""
    mine = msgspec.json.encode(Fingerprint(fingerprint, spec.node))
    _, kv = await etcd.put_if_absent(spec.fingerprint_key, mine)
    stored = msgspec.json.decode(kv.value, type=Fingerprint)
    if stored.fingerprint != fingerprint:
        raise FingerprintMismatch(
            f"cluster {spec.name!r} serves model fingerprint {stored.fingerprint} "
            f"(first set by node {stored.node!r}, etcd key {spec.fingerprint_key}); "
            f"node {spec.node!r} has {fingerprint}; give this node its own "
            "cluster.name, or the same model"
        )


async def register(
    etcd: EtcdClient,
    spec: ClusterSpec,
    me: NodeInfo,
    lease: int,
    clock: Callable[[], float],
    deadline: float,
    given_up: set[int] | None = None,
) -> None:
    """Create nodes/<node> on `lease`. Held by `lease` itself (a session that took up its
    stalled lease again): put it afresh. Held by a lease of this node's own that it gave up
    (`given_up`): revoke that and try again at once. Held by another lease: wait until
    `deadline` for it to expire (a crashed predecessor's does), then DuplicateNode naming
    the holder."""
    key = spec.node_key(me.node)
    mine = given_up if given_up is not None else set()
    while True:
        created, kv = await etcd.put_if_absent(key, msgspec.json.encode(me), lease=lease)
        if created:
            return
        if kv.lease == lease:  # a session that took up its stalled lease again
            await etcd.put(key, msgspec.json.encode(me), lease=lease)
            return
        if kv.lease in mine:
            await etcd.revoke(kv.lease)  # the keys on it go with it, this name included
            mine.discard(kv.lease)
            continue
        if clock() >= deadline:
            other = msgspec.json.decode(kv.value, type=NodeInfo)
            raise DuplicateNode(
                f"cluster {spec.name!r}: node name {me.node!r} is held by a live "
                f"supervisor (pid {other.pid} on {other.host}, lease {kv.lease:x}); "
                "give this node another cluster.node"
            )
        await asyncio.sleep(spec.renew_s)


class View:
    """What this node knows of the cluster's keys, kept current by the watch."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.leader: KeyValue | None = None
        self.nodes: dict[str, NodeInfo] = {}
        self.revision = 0  # the store revision this view is current as of

    def load(self, kvs: list[KeyValue], revision: int = 0) -> None:
        self.leader, self.nodes, self.revision = None, {}, revision
        for kv in kvs:
            self.apply(kv, deleted=False)

    def apply(self, kv: KeyValue, *, deleted: bool) -> None:
        self.revision = max(self.revision, kv.mod_revision)
        key = kv.key.decode()
        if key == self.spec.leader_key:
            self.leader = None if deleted else kv
        elif key.startswith(self.spec.nodes_prefix):
            name = key[len(self.spec.nodes_prefix) :]
            if deleted:
                self.nodes.pop(name, None)
            else:
                self.nodes[name] = msgspec.json.decode(kv.value, type=NodeInfo)

    @property
    def leader_node(self) -> str | None:
        return None if self.leader is None else self.leader.value.decode()
