"""A `supervisor run` with a `cluster:` section: this node's part in the fleet.

`Node` owns the etcd client and the `Elector` for as long as the supervisor runs. It tells
the elector whether the local crew can serve (`whole`), turns the elector's changes into
events (MQTT included) and a retained per-node state, and, on becoming leader, raises the
local epoch above anything any earlier leader used and tells the primary (`EPOCH_SHIFT`).

`FleetView` is what the router asks where a request goes: the local primary while this
node leads (checked per request with `Elector.is_leader()`), else the leader node's router
as registered in etcd, followed through the elector's watch. Streams from the local
primary are cut when leadership ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import structlog

from holdfast_contract.control import FleetNodeStatus, FleetStatus
from holdfast_contract.events import EventName as N
from supervisor.core import Crew
from supervisor.events import EventBus, UnitState
from supervisor.fleet.election import Elector
from supervisor.fleet.etcd import EtcdClient
from supervisor.fleet.roles import Change, Event, Role, StepDown
from supervisor.fleet_spec import ClusterSpec
from supervisor.policy import split_listen
from supervisor.primary import LeadershipEnded, PrimaryView, Target
from supervisor.states import EngineState

log = structlog.get_logger("holdfast.fleet")

# the elector's changes published under their own names (`fleet.<node>.joined`); the
# others have theirs in `Node._changed`
OWN_NAME: dict[Event, N] = {Event.JOINED: N.JOINED, Event.STOP: N.STOP}

# A leader's engine epoch is at least its term's epoch (the leader key's create revision)
# shifted left by this many bits; local failovers within the term add one each. Terms'
# epochs only grow, so X-Holdfast-Epoch grows across leaderships as long as one term has
# fewer than 2**20 local failovers.
EPOCH_SHIFT = 20


def term_floor(cluster_epoch: int) -> int:
    """The lowest engine epoch a leader of term `cluster_epoch` uses."""
    return cluster_epoch << EPOCH_SHIFT


def whole(c: Crew) -> bool:
    """The crew can serve: every cache daemon serves and a primary is promoted."""
    p = c.primary
    return p is not None and p.state == EngineState.PRIMARY and c.daemons.all_serving()


class FleetView(PrimaryView):
    """The local primary (`target`, set by the crew) behind the cluster's leadership."""

    def __init__(self, node: str) -> None:
        super().__init__()
        self.node = node
        self.elector: Elector | None = None
        self._scopes: set[asyncio.Timeout] = set()
        self._remote: dict[asyncio.Timeout, int] = {}  # forwarded: the term sent to

    def route(self) -> Target | None:
        e = self.elector
        if e is None:
            return None
        if e.is_leader():
            t = self.target
            return None if t is None else replace(t, node=self.node, cluster_epoch=e.epoch)
        leader = e.view.leader_node
        info = e.view.nodes.get(leader) if leader is not None else None
        if leader is None or leader == self.node or info is None or not info.router:
            return None
        host, port = split_listen(info.router)
        epoch = e.cluster_epoch
        return Target(leader, port, term_floor(epoch), host, leader, epoch, remote=True)

    def valid(self, target: Target) -> bool:
        e = self.elector
        if target.remote:
            return True
        return e is not None and e.is_leader() and e.epoch == target.cluster_epoch

    def misdirected(self) -> bool:
        return self.elector is None or not self.elector.is_leader()

    @contextlib.asynccontextmanager
    async def serving(self, target: Target) -> AsyncIterator[None]:
        """A request to the local primary lives while this node leads: looked at again at
        each term deadline (renewals move it), cut at once when the node steps down. One
        forwarded to the leader's router lives while that node is the leader seen here:
        when the leader key is gone or held by another term, a leader that went silent
        (cut off, stopped) would never answer it, so it is cut and, before its first
        byte, retried on the next leader."""
        e = self.elector
        if e is None:
            yield
            return
        if target.remote:
            async with self._while_leading_elsewhere(e, target):
                yield
            return
        loop = asyncio.get_running_loop()
        handle: asyncio.TimerHandle | None = None
        try:
            async with asyncio.timeout(None) as scope:

                def check() -> None:
                    nonlocal handle
                    deadline = e.term_deadline if e.is_leader() else None
                    if deadline is None:
                        scope.reschedule(loop.time())  # expires now
                    else:
                        handle = loop.call_later(max(0.0, deadline - e.clock()), check)

                check()
                self._scopes.add(scope)
                try:
                    yield
                finally:
                    self._scopes.discard(scope)
                    if handle is not None:
                        handle.cancel()
        except TimeoutError:
            if scope.expired():
                raise LeadershipEnded(f"node {self.node} stopped leading") from None
            raise

    @contextlib.asynccontextmanager
    async def _while_leading_elsewhere(self, e: Elector, target: Target) -> AsyncIterator[None]:
        try:
            async with asyncio.timeout(None) as scope:
                self._remote[scope] = target.cluster_epoch
                if e.cluster_epoch != target.cluster_epoch:
                    scope.reschedule(asyncio.get_running_loop().time())
                try:
                    yield
                finally:
                    self._remote.pop(scope, None)
        except TimeoutError:
            if scope.expired():
                raise LeadershipEnded(f"the term of {target.node} ended") from None
            raise

    def changed(self, stepped_down: bool) -> None:
        """The elector saw a change: wake waiting requests; cut local streams if this
        node stopped leading, and forwarded ones whose leader's term is no longer the
        one seen."""
        now = asyncio.get_running_loop().time()
        if stepped_down:
            for scope in list(self._scopes):
                if not scope.expired():  # one expiring already must not be rescheduled
                    scope.reschedule(now)
        epoch = self.elector.cluster_epoch if self.elector is not None else 0
        for scope, term in list(self._remote.items()):
            if term != epoch and not scope.expired():
                scope.reschedule(now)
        self.wake()


class Node:
    """This node in the cluster, for the life of `supervisor run`."""

    def __init__(
        self, spec: ClusterSpec, api: str, bus: EventBus, crew: Crew, view: FleetView
    ) -> None:
        self.spec, self.bus, self.crew, self.view = spec, bus, crew, view
        host, _ = split_listen(spec.advertise)
        self.api = f"{host}:{split_listen(api)[1]}"  # the health API, on the advertised host
        self.elector: Elector | None = None

    async def run(self, fingerprint: str) -> None:
        """Join, campaign and follow until cancelled; raises JoinRefused if refused."""
        c = self.crew
        async with (
            EtcdClient(self.spec.etcd, timeout_s=self.spec.renew_s) as etcd,
            Elector(
                etcd,
                self.spec,
                fingerprint,
                healthy=whole(c),
                on_change=self._changed,
                api=self.api,
            ) as e,
        ):
            self.elector = self.view.elector = e
            self._state(e)
            try:
                await asyncio.gather(self._follow_crew(e), self._report_failures(e))
            finally:
                self.view.elector = None  # leaving: nothing is routed by a stale view
                self.view.changed(stepped_down=True)

    async def _follow_crew(self, e: Elector) -> None:
        """Tell the elector each time the crew's health changes (every event is a chance)."""
        events = self.bus.subscribe()
        healthy = e.healthy
        while True:
            await events.get()
            if whole(self.crew) != healthy:
                healthy = not healthy
                e.set_healthy(healthy)
                self.bus.emit("fleet", self.spec.node, N.HEALTH, e.cluster_epoch, healthy=healthy)

    async def _report_failures(self, e: Elector) -> None:
        """Each failed session start as an event and an error naming the endpoints; the
        join refusal raised (the supervisor exits with it)."""
        seen = 0

        def more(x: Elector) -> bool:
            return len(x.failures) > seen

        while True:
            await e.wait_for(more, timeout=float("inf"))
            for _, why in e.failures[seen:]:
                log.error("fleet.etcd_unreachable", endpoints=self.spec.etcd, error=why)
                self.bus.emit("fleet", self.spec.node, N.ETCD_UNREACHABLE, 0, error=why)
            seen = len(e.failures)

    def _changed(self, e: Elector, change: Change) -> None:
        node = self.spec.node
        if change in (Event.WON, Event.RESUMED):
            self._take_term(e)
        self.view.changed(stepped_down=isinstance(change, StepDown) or change is Event.STOP)
        data: dict[str, Any] = {"role": e.role.value, "leader": e.view.leader_node}
        if isinstance(change, StepDown):
            reason = change.reason
            self.bus.emit("fleet", node, N.STEPPED_DOWN, e.epoch, reason=reason, **data)
        elif change is Event.WON:
            self.bus.emit("fleet", node, N.BECAME_LEADER, e.epoch, **data)
        elif change is Event.RESUMED:
            self.bus.emit("fleet", node, N.RESUMED_LEADER, e.epoch, **data)
        elif change is Event.SESSION_LOST:
            self.bus.emit("fleet", node, N.LEASE_LOST, e.cluster_epoch, **data)
        elif change is Event.REFUSED:
            self.bus.emit("fleet", node, N.JOIN_REFUSED, 0, error=str(e.error), **data)
        elif change is Event.LEADER:
            leader = e.view.leader_node
            if leader is None:
                self.bus.emit("fleet", node, N.LEADER_VACANT, 0, **data)
            else:
                self.bus.emit("fleet", node, N.LEADER_ELECTED, e.cluster_epoch, **data)
                if leader != node:
                    self.bus.emit("fleet", node, N.FOLLOWER_OF, e.cluster_epoch, **data)
        else:  # joined, stop: published under their own names
            self.bus.emit("fleet", node, OWN_NAME[change], e.cluster_epoch, **data)
        self._state(e)

    def _take_term(self, e: Elector) -> None:
        """A new term, or a lapsed one resumed: the crew's epoch jumps to at least the
        term's floor (one past the last, on a resume) and its primary is told
        (`Crew.raise_epoch`), so the engine's epoch grows across leaderships."""
        self.crew.raise_epoch(term_floor(e.epoch), cluster_epoch=e.epoch)

    def _state(self, e: Elector) -> None:
        """The retained `<prefix>/node/<node>/state` on MQTT."""
        st = UnitState(
            ts=time.time(),
            kind="node",
            name=self.spec.node,
            state=_role(e),
            epoch=e.cluster_epoch,
            role=_role(e),
            pid=os.getpid(),
        )
        self.bus.state(st)

    def status(self) -> FleetStatus:
        """The health API's cluster view."""
        e = self.elector
        if e is None:
            return FleetStatus(
                cluster=self.spec.name,
                node=self.spec.node,
                role="starting",
                healthy=whole(self.crew),
                epoch=0,
                cluster_epoch=0,
            )
        leader = e.view.leader_node
        info = e.view.nodes.get(leader) if leader else None
        age = e.lease_age_s
        nodes = [
            FleetNodeStatus(
                node=n.node,
                role="leader" if n.node == leader else "follower",
                healthy=n.healthy,
                priority=n.priority,
                router=n.router,
                api=n.api,
                host=n.host,
                pid=n.pid,
            )
            for n in sorted(e.view.nodes.values(), key=lambda n: n.node)
        ]
        return FleetStatus(
            cluster=self.spec.name,
            node=self.spec.node,
            role=_role(e),
            healthy=e.healthy,
            epoch=e.epoch,
            cluster_epoch=e.cluster_epoch,
            leader=leader,
            leader_router=info.router if info is not None else None,
            lease_age_s=None if age is None else round(age, 3),
            nodes=nodes,
        )

    def is_leader(self) -> bool:
        return self.elector is not None and self.elector.is_leader()


def _role(e: Elector) -> str:
    """The elector's role, with a leader past its hold deadline not called leader."""
    role = e.role.value
    return "stepping-down" if e.role is Role.LEADER and not e.is_leader() else role
