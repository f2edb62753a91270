"""The election's decisions as plain functions of a snapshot and a clock reading.

`Term` answers whether a leader may still serve; `may_campaign` and `yield_to` apply the
priority rule. The elector (election.py) only carries these out against etcd, and moves
its role through `roles.ROLE`.
"""

from __future__ import annotations

import msgspec


class NodeInfo(msgspec.Struct, frozen=True):
    """What a node publishes under /<prefix>/<cluster>/nodes/<node> (on its lease)."""

    node: str
    fingerprint: str
    priority: int = 0
    healthy: bool = True
    pid: int = 0
    host: str = ""
    router: str = ""  # HOST:PORT of the node's router (cluster.advertise)
    api: str = ""  # HOST:PORT of the node's health API
    # how long after its last renewal was sent this node serves as leader (hold_s), in ms;
    # 0: not said, and the others wait for etcd to expire its lease (see early_revoke)
    hold_ms: int = 0


class Term(msgspec.Struct, frozen=True):
    """One leadership: its epoch (the leader key's create revision) and the send time of
    the lease's last successful renewal. etcd restarts the lease's TTL when the renewal
    arrives, which is after it was sent, so the lease cannot expire before
    `renewed_at + ttl`; the leader serves only until `renewed_at + hold_s`
    (hold_s = ttl - margin)."""

    epoch: int
    renewed_at: float
    hold_s: float

    @property
    def deadline(self) -> float:
        return self.renewed_at + self.hold_s

    def holds(self, now: float) -> bool:
        return now < self.deadline


def higher(me: NodeInfo, nodes: dict[str, NodeInfo]) -> list[NodeInfo]:
    """Healthy nodes of higher priority than `me`, highest first."""
    found = [n for n in nodes.values() if n.node != me.node and n.healthy]
    return sorted((n for n in found if n.priority > me.priority), key=lambda n: -n.priority)


def may_campaign(
    me: NodeInfo, nodes: dict[str, NodeInfo], vacant_since: float, now: float, wait_s: float
) -> bool:
    """With the leader key vacant: a healthy node campaigns unless a healthy node of higher
    priority is registered, and even then once the key has stayed vacant `wait_s` (that
    node may be stuck)."""
    if not me.healthy:
        return False
    return not higher(me, nodes) or now - vacant_since >= wait_s


def yield_to(
    me: NodeInfo,
    nodes: dict[str, NodeInfo],
    seen_since: dict[str, float],
    now: float,
    wait_s: float,
    unhealthy_since: float | None = None,
) -> str | None:
    """The node a leader hands leadership to, or None to keep it: the highest-priority
    healthy node seen healthy for `wait_s` (no flapping on a node that just came up) that
    either has a higher priority, or any such node once this leader's own crew has not
    been whole for `wait_s` (a local failover, quicker than that, moves nothing)."""
    sick = unhealthy_since is not None and now - unhealthy_since >= wait_s
    ready = [
        n
        for n in nodes.values()
        if n.node != me.node and n.healthy and now - seen_since.get(n.node, now) >= wait_s
    ]
    for node in sorted(ready, key=lambda n: -n.priority):
        if node.priority > me.priority or sick:
            return node.node
    return None


class LeaseReading(msgspec.Struct, frozen=True):
    """One answer of etcd's lease TimeToLive, timed on the reader's clock: `ttl` is the
    remaining TTL in whole seconds rounded down (-1: the lease is gone), `granted` the TTL
    each renewal restarts it at."""

    lease: int
    sent: float  # the request left (etcd computed `ttl` after this)
    answered: float  # the answer came (etcd computed `ttl` before this)
    ttl: int
    granted: int

    def bound(self, hold_s: float) -> float:
        """After this clock reading the lease's holder serves no more, unless a renewal
        etcd processed after this reading moved it. The holder's last renewal, sent at
        `s`, was processed at `p >= s` and restarted the lease there, so the lease expires
        at `p + granted`; remaining < ttl + 1 at some moment before `answered` puts `p`
        before `answered + ttl + 1 - granted`, and the holder serves only until
        `s + hold_s <= p + hold_s`."""
        return self.answered + self.ttl + 1 - self.granted + hold_s


def unrenewed(first: LeaseReading, later: LeaseReading) -> bool:
    """Whether `later` proves etcd processed no renewal of the lease between the two
    readings: one at `p` after `first` would leave more than `first.sent + granted -
    later.answered` remaining at `later`, which its rounded-down `ttl` rules out."""
    return later.ttl + 1 <= first.sent + first.granted - later.answered


def early_revoke(
    first: LeaseReading | None, now: LeaseReading, hold_s: float, guard_s: float
) -> tuple[LeaseReading | None, bool]:
    """Whether a follower may free the leader's key now, before etcd expires its lease:
    (the reading to keep for the next call, free now).

    It may once a reading `first` bounds when the holder stopped serving
    (`first.bound(hold_s)`, the holder's own hold_s), a later reading sent after that
    bound (plus `guard_s` for clock rates) shows no renewal since `first`, and the holder
    takes no renewal answered after its deadline as one (Elector._renew). A renewal etcd
    processes after `now` is answered after the bound: the holder has stopped by then, and
    leads again only by moving its key (Elector._resume), which the follower's delete,
    conditional on the key's version read before `now`, then fails on. `hold_s <= 0`
    (not published): never."""
    if now.ttl < 0 or hold_s <= 0:
        return None, False
    if first is None or first.lease != now.lease or not unrenewed(first, now):
        return now, False
    if now.sent >= first.bound(hold_s) + guard_s:
        return None, True
    return (now if now.bound(hold_s) < first.bound(hold_s) else first), False
