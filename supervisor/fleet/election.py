"""One node's part in the cluster election, carried out against etcd.

`async with Elector(etcd, spec, fingerprint) as e:` joins the cluster: a session lease
(TTL `spec.ttl_s`, renewed every `spec.renew_s`) carries this node's registration and,
while it leads, the leader key. Joining checks the cluster's model fingerprint and that no
live node holds the same node name. `e.is_leader()` is true only while the lease's last
successful renewal was sent less than `spec.hold_s` ago, whatever etcd's state: a leader
cut off from etcd stops serving before its lease can expire, so no other node can be
elected while it still serves. `e.epoch` is the leader key's create revision.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Callable
from types import TracebackType

import msgspec
import structlog

from supervisor.fleet.decide import (
    LeaseReading,
    NodeInfo,
    Term,
    early_revoke,
    may_campaign,
    yield_to,
)
from supervisor.fleet.errors import (
    DuplicateNode,
    EtcdError,
    EtcdUnavailable,
    FingerprintMismatch,
    FleetError,
    JoinRefused,
    LeaseLost,
    LeaseStale,
)
from supervisor.fleet.etcd import EtcdClient, KeyValue
from supervisor.fleet.registry import View, check_fingerprint, register
from supervisor.fleet.roles import ROLE, Change, Event, Role, StepDown, Why, event_of
from supervisor.fleet_spec import ClusterSpec

log = structlog.get_logger("holdfast.fleet")
GUARD_S = 0.05  # added to a revoke's bound: clock rates of two machines differ by ppm
Clock = Callable[[], float]
__all__ = ["DuplicateNode", "Elector", "FingerprintMismatch", "FleetError"]


def _lost_cancel() -> None:
    """Raise the cancellation of this task if a library swallowed it: a connect cancelled
    half-way can come back as a connection error, and a task group whose child goes on
    looping after that waits for it for ever (seen under load, with etcd frozen)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


class Elector:
    def __init__(
        self,
        etcd: EtcdClient,
        spec: ClusterSpec,
        fingerprint: str,
        *,
        healthy: bool = True,
        clock: Clock = time.monotonic,
        on_change: Callable[[Elector, Change], None] | None = None,
        max_backoff_s: float = 5.0,
        api: str = "",
    ) -> None:
        self.etcd, self.spec, self.fingerprint, self.clock = etcd, spec, fingerprint, clock
        self.healthy = healthy
        self._unhealthy_since: float | None = None if healthy else clock()
        self.on_change = on_change
        self.max_backoff_s = max_backoff_s
        self.api = api
        self.role = Role.STARTING
        self.term: Term | None = None
        self.view = View(spec)
        self.error: JoinRefused | None = None
        self.failures: list[tuple[float, str]] = []  # (clock, why) each failed session start
        self.stepdowns: list[StepDown] = []
        self.lease = 0
        # leases this node gave up without etcd confirming their end (it stopped answering
        # in time, or an etcd leader change kept them alive): still this node's, and
        # revoked when a join finds its name registered on one
        self._given_up: set[int] = set()
        # leader keys this node deleted once etcd's TTL readings proved their holder had
        # stopped serving: (clock, the holder's lease, the bound the first reading gave)
        self.freed: list[tuple[float, int, float]] = []
        # this node's last term, while it lapsed for want of a fresh renewal (its key may
        # outlive it: an etcd leader change stalls renewals but keeps leases): see _resume
        self._lapsed: Term | None = None
        self._stale_lease = 0  # a lease given up unrenewed that etcd may have kept alive
        self.renewals = 0  # successful lease renewals: a clock for watching nothing happen
        self._renewed_at = 0.0
        self._ttl = float(spec.ttl_s)
        self._vacant_since = 0.0
        self._seen: dict[str, float] = {}
        self._published: NodeInfo | None = None
        self._reported_leader: tuple[str | None, int] = (None, 0)
        self._changed = asyncio.Event()
        self._wake = asyncio.Event()
        self._reconnect = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._live = False  # the current session's parts run

    async def __aenter__(self) -> Elector:
        self._task = asyncio.create_task(self._run(), name=f"elector-{self.spec.node}")
        self._task.add_done_callback(lambda _: self._notify())  # a crash wakes the waiters
        return self

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.role is Role.STOPPED:
            return
        crash: BaseException | None = None
        self._part_ended(None)
        if self._task is not None:
            self._task.cancel()
            (crash,) = await asyncio.gather(self._task, return_exceptions=True)
        if self.role == Role.LEADER:
            self._step_down(Why.STOP)
        if self.role != Role.FAILED:
            self._set(Event.STOP)
        for lease in sorted({self.lease, self._stale_lease} - {0}):
            try:  # frees the leader key and the node name at once
                await self.etcd.revoke(lease, timeout=self.spec.renew_s)
            except EtcdError as exc:
                log.warning("lease not revoked", node=self.spec.node, error=str(exc))
        if isinstance(crash, Exception):
            raise crash  # a bug in the elector: never hidden

    # what the supervisor asks
    def is_leader(self) -> bool:
        return self.role == Role.LEADER and self.term is not None and self.term.holds(self.clock())

    @property
    def epoch(self) -> int:
        """The epoch of this node's current or last term; 0 before it first led."""
        return self.term.epoch if self.term is not None else 0

    @property
    def cluster_epoch(self) -> int:
        """The epoch of the leader this node sees now (its key's create revision); 0: none."""
        return self.view.leader.create_revision if self.view.leader is not None else 0

    @property
    def term_deadline(self) -> float | None:
        """While leading: the clock reading at which `is_leader()` turns false unless a
        renewal moves it (what in-flight streams are cut at)."""
        return self.term.deadline if self.role == Role.LEADER and self.term else None

    @property
    def lease_age_s(self) -> float | None:
        """Seconds since the last successful renewal was sent; None without a session."""
        return self.clock() - self._renewed_at if self.lease else None

    def set_healthy(self, healthy: bool) -> None:
        """Whether this node's crew is whole: an unhealthy node does not campaign, and a
        leader unhealthy for ttl_s hands over to a healthy node."""
        if healthy:
            self._unhealthy_since = None
        elif self._unhealthy_since is None:
            self._unhealthy_since = self.clock()
        self.healthy = healthy
        self._wake.set()

    async def wait_for(self, predicate: Callable[[Elector], bool], timeout: float) -> None:
        """Until `predicate(self)`; the join error if joining was refused; TimeoutError."""
        async with asyncio.timeout(timeout):
            while not predicate(self):
                if self.error is not None:
                    raise self.error
                if self._task is not None and self._task.done() and not self._task.cancelled():
                    raise RuntimeError(f"elector {self.spec.node} died") from self._task.exception()
                changed = self._changed
                await changed.wait()

    # state
    def _set(self, change: Change) -> None:
        """The move `roles.ROLE` has for (role, change's event), reported; raises
        IllegalTransition when there is no such row."""
        self.role = ROLE.lookup(self.role, event_of(change)).dst
        self._report(change)

    def _report(self, change: Change) -> None:
        """One change, logged and handed to `on_change`: a role change, or `leader` when
        the leader this node sees changed (what a router follows)."""
        log.info(
            f"fleet.{change}",
            node=self.spec.node,
            role=self.role.value,
            epoch=self.epoch,
            leader=self.view.leader_node,
            cluster_epoch=self.cluster_epoch,
        )
        if self.on_change is not None:
            self.on_change(self, change)
        self._notify()

    def _notify(self) -> None:
        self._changed.set()  # wakes every waiter; later ones wait on a fresh event
        self._changed = asyncio.Event()

    def _step_down(self, why: Why, to: str = "") -> None:
        down = StepDown(self.clock(), why, self._renewed_at + self._ttl, to)
        self.stepdowns.append(down)
        self._lapsed = self.term if down.lapsed else None
        self._set(down)

    @property
    def _hold_s(self) -> float:
        return self._ttl - self.spec.margin_s

    def _me(self) -> NodeInfo:
        return NodeInfo(
            self.spec.node,
            self.fingerprint,
            self.spec.priority,
            self.healthy,
            os.getpid(),
            socket.gethostname(),
            self.spec.advertise,
            self.api,
            round(self._hold_s * 1000),
        )

    # the loop
    async def _run(self) -> None:
        first = delay = min(0.1, self.spec.renew_s)
        while True:
            try:
                await self._session()
            except JoinRefused as exc:
                self.error = exc
                self._set(Event.REFUSED)
                log.error("fleet.refused", node=self.spec.node, error=str(exc))
                await self._drop_lease()
                return
            except EtcdError as exc:
                self.failures.append((self.clock(), str(exc)))
                if self.role != Role.STARTING:  # it had joined: start over from a short wait
                    delay = first
                if self.role == Role.LEADER:
                    self._step_down(Why.SESSION_LOST)
                if self.role == Role.FOLLOWER:
                    # the view stays until the next session reads the keys afresh: the
                    # leader last seen is where requests go meanwhile (its router checks
                    # its own term), so a node woken from a pause forwards at once
                    self._set(Event.SESSION_LOST)
                log.warning(
                    "fleet.etcd_failed", node=self.spec.node, error=str(exc), retry_in_s=delay
                )
                self._notify()
                await self._drop_lease(keep=isinstance(exc, LeaseStale))
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.max_backoff_s)

    async def _drop_lease(self, keep: bool = False) -> None:
        """Leave the session's lease: revoked, or with `keep` (its renewals stalled while
        etcd did not answer) left as it is, for the next session to take up if etcd kept
        it alive (see `_open_lease`)."""
        if self.lease:
            lease, self.lease = self.lease, 0
            self._given_up.add(lease)  # until revoked: its keys are this node's own
            if keep:
                self._stale_lease = lease
                return
            with contextlib.suppress(EtcdError):  # else it expires by itself within ttl_s
                await self.etcd.revoke(lease, timeout=self.spec.renew_s)
                self._given_up.discard(lease)

    async def _open_lease(self) -> tuple[int, int]:
        """The session's lease: the one whose renewals stalled, if a renewal of it comes
        through now (etcd elected a new raft leader, which keeps leases alive: the keys
        on it, a lapsed term's leader key among them, are still this node's), else a new
        one. (id, TTL)."""
        stale = self._stale_lease
        if stale:
            try:
                ttl = await self.etcd.keepalive(stale)
            except LeaseLost:  # expired: its keys went with it
                self._stale_lease = 0
                self._given_up.discard(stale)
            else:
                self._stale_lease = 0
                self._given_up.discard(stale)
                log.info("fleet.lease_kept", node=self.spec.node, lease=f"{stale:x}")
                return stale, ttl
        return await self.etcd.grant(self.spec.ttl_s)

    async def _session(self) -> None:
        sent = self.clock()
        self.lease, granted = await self._open_lease()
        self._renewed_at, self._ttl = sent, float(min(granted, self.spec.ttl_s))
        await self._join()
        self._set(Event.JOINED)
        self._live = True
        try:
            async with asyncio.TaskGroup() as tasks:
                parts = (self._renew(), self._watch(), self._decide(), self._expire_leader())
                for work in parts:
                    tasks.create_task(work).add_done_callback(self._part_ended)
        except* EtcdError as group:
            raise group.exceptions[0] from None

    def _part_ended(self, task: asyncio.Task[None] | None) -> None:
        """One part of the session ended: the others end too, at their next turn, even
        if the task group's cancellation of them was lost (see `_lost_cancel`)."""
        self._live = False
        self._wake.set()
        self._reconnect.set()

    async def _join(self) -> None:
        me = self._me()
        await check_fingerprint(self.etcd, self.spec, self.fingerprint)
        deadline = self.clock() + self._ttl + self.spec.margin_s
        await register(self.etcd, self.spec, me, self.lease, self.clock, deadline, self._given_up)
        self._published = me

    async def _renew(self) -> None:
        """Renew the lease every renew_s; each try's deadline is the leader's deadline, so
        a leader cut off from etcd regains control in time to step down."""
        while self._live:
            if self.role == Role.LEADER and self.term and not self.term.holds(self.clock()):
                self._step_down(Why.RENEWAL_STALE)
                self._wake.set()
            sent = self.clock()
            timeout = self.spec.renew_s
            if self.role == Role.LEADER and self.term and self.term.deadline > sent:
                timeout = min(timeout, self.term.deadline - sent)
            try:
                await self.etcd.keepalive(self.lease, timeout=timeout)
                if self.role == Role.LEADER and self.term and not self.term.holds(self.clock()):
                    # answered past the term's deadline: the term is over whatever etcd
                    # says, as early_revoke assumes (a follower may free the key now); it
                    # leads again only through _resume
                    self._step_down(Why.RENEWAL_LATE)
                    self._wake.set()
                self._renewed_at = sent
                if self.term is not None and self.role == Role.LEADER:
                    self.term = msgspec.structs.replace(self.term, renewed_at=sent)
                self.renewals += 1
                if self._lapsed is not None:
                    self._wake.set()  # a lapsed term may resume now
                self._notify()
            except LeaseLost:
                raise
            except EtcdUnavailable as exc:
                _lost_cancel()
                self._reconnect.set()  # the watch may hang on an endpoint that is cut off
                if self.clock() >= self._renewed_at + self._ttl:
                    raise LeaseStale(f"lease {self.lease:x} expired unrenewed: {exc}") from exc
                continue  # no sleep: the request itself waited
            await asyncio.sleep(max(0.0, sent + self.spec.renew_s - self.clock()))

    async def _expire_leader(self) -> None:
        """A follower reads the leader's lease TTL every `lease_poll_s` and deletes the
        leader key once the readings prove its holder has stopped serving
        (decide.early_revoke), with a compare on the key's version read before the reading
        (`_free_leader`): the key is free at the holder's own deadline instead of at etcd's
        expiry, which comes up to margin_s plus etcd's expiry check (500 ms) later."""
        first: LeaseReading | None = None
        while self._live:
            leader, view = self.view.leader, self.view
            holder = view.nodes.get(view.leader_node or "") if leader is not None else None
            if (
                self.role != Role.FOLLOWER
                or leader is None
                or leader.lease in (0, self.lease)
                or holder is None
                or holder.hold_ms <= 0
            ):
                first = None
                await asyncio.sleep(self.spec.lease_poll_s)
                continue
            sent = self.clock()
            try:
                ttl, granted = await self.etcd.time_to_live(leader.lease, timeout=self.spec.renew_s)
            except EtcdError as exc:
                _lost_cancel()
                log.debug("fleet.lease_read_failed", node=self.spec.node, error=str(exc))
                first = None
                await asyncio.sleep(self.spec.lease_poll_s)
                continue
            hold_s = holder.hold_ms / 1000
            reading = LeaseReading(leader.lease, sent, self.clock(), ttl, granted)
            kept, due = early_revoke(first, reading, hold_s, GUARD_S)
            if due and first is not None:
                await self._free_leader(leader, first.bound(hold_s), view.leader_node)
            first = kept
            wake = sent + self.spec.lease_poll_s
            if first is not None:  # the read that may confirm: at the bound, not later
                wake = min(wake, first.bound(hold_s) + GUARD_S)
            await asyncio.sleep(max(0.0, wake - self.clock()))

    async def _free_leader(self, key: KeyValue, bound: float, holder: str | None) -> None:
        """Delete the leader key if it is still the version read before the TTL reading
        that proved its holder stopped (a holder that resumed since has moved it: see
        `_resume`), then the holder's registration if it is on the same lease."""
        try:
            if not await self.etcd.delete_if_unchanged(
                self.spec.leader_key, key.mod_revision, timeout=self.spec.renew_s
            ):
                log.info("fleet.leader_key_moved", node=self.spec.node, holder=holder)
                return
        except EtcdError as exc:
            _lost_cancel()
            log.info("fleet.free_failed", node=self.spec.node, holder=holder, error=str(exc))
            return
        self.freed.append((self.clock(), key.lease, bound))
        log.info(
            "fleet.freed_stopped_leader",
            node=self.spec.node,
            holder=holder,
            lease=f"{key.lease:x}",
            after_bound_ms=round((self.clock() - bound) * 1000, 1),
        )
        if holder is not None:
            try:  # a holder that is alive puts it back (Elector._decide_once)
                await self.etcd.delete_if_leased(
                    self.spec.node_key(holder), key.lease, timeout=self.spec.renew_s
                )
            except EtcdError as exc:
                _lost_cancel()
                log.info("fleet.free_failed", node=self.spec.node, holder=holder, error=str(exc))

    async def _watch(self) -> None:
        """Follow the cluster's keys; start over when the stream breaks or a renewal
        failed (the stream's endpoint may be the one cut off)."""
        while self._live:
            self._reconnect.clear()
            stream = asyncio.create_task(self._follow())
            reconnect = asyncio.create_task(self._reconnect.wait())
            try:
                await asyncio.wait({stream, reconnect}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stream.cancel()
                reconnect.cancel()
                results = await asyncio.gather(stream, reconnect, return_exceptions=True)
            _lost_cancel()
            if isinstance(results[0], EtcdError):
                log.info("fleet.watch_restarting", node=self.spec.node, error=str(results[0]))
                await asyncio.sleep(self.spec.renew_s)
            elif isinstance(results[0], BaseException) and not stream.cancelled():
                raise results[0]

    async def _follow(self) -> None:
        revision, kvs = await self.etcd.get_prefix(self.spec.root)
        self.view.load(kvs, revision)
        self._wake.set()
        async for event in self.etcd.watch(self.spec.root, revision + 1):
            self.view.apply(event.kv, deleted=event.type == "DELETE")
            self._wake.set()

    async def _decide(self) -> None:
        """Decide at each change seen, every renew_s, and at the term's deadline: a leader
        whose hold ran out (a stalled renewal, or this process stopped past it) steps down
        by its clock at once, whatever its renewal still waits for."""
        while self._live:
            wait = self.spec.renew_s
            if self.role == Role.LEADER and self.term is not None:
                wait = min(wait, max(0.0, self.term.deadline - self.clock()))
            try:
                async with asyncio.timeout(wait):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            if self.role == Role.LEADER and self.term and not self.term.holds(self.clock()):
                self._step_down(Why.RENEWAL_STALE)
            try:
                await self._decide_once()
            except EtcdUnavailable as exc:  # the renewals decide whether the session lives
                _lost_cancel()
                log.info("fleet.decide_failed", node=self.spec.node, error=str(exc))

    async def _decide_once(self) -> None:
        now, me, view = self.clock(), self._me(), self.view
        leader = (view.leader_node, self.cluster_epoch)
        if leader != self._reported_leader:
            self._reported_leader = leader
            self._report(Event.LEADER)
        if me != self._published or (view.revision and me.node not in view.nodes):
            # changed, or deleted by a follower that took this node for stopped
            await self.etcd.put(
                self.spec.node_key(me.node), msgspec.json.encode(me), lease=self.lease
            )
            self._published = me
        for name in list(self._seen):
            if name not in view.nodes or not view.nodes[name].healthy:
                del self._seen[name]
        for name, info in view.nodes.items():
            if info.healthy:
                self._seen.setdefault(name, now)
        if view.leader is None and self._vacant_since == 0.0:
            self._vacant_since = now
        elif view.leader is not None:
            self._vacant_since = 0.0
        if self.role == Role.LEADER and self.term is not None:
            await self._lead(now, me)
        elif view.leader is not None and view.leader.lease == self.lease:
            # a term this node gave up while the key outlived it: lead on, or clear it
            if not await self._resume(view.leader, now, me):
                await self.etcd.delete_if_created(self.spec.leader_key, view.leader.create_revision)
        elif (
            view.leader is None
            and self._renewed_at + self._hold_s > now  # a stale lease may expire mid-term
            and may_campaign(me, view.nodes, self._vacant_since, now, self._ttl)
        ):
            await self._campaign()
        self._notify()

    async def _lead(self, now: float, me: NodeInfo) -> None:
        assert self.term is not None
        leader = self.view.leader
        if leader is None and self.view.revision > self.term.epoch:
            self._step_down(Why.KEY_GONE)  # deleted behind this node's back
            return
        if leader is not None and leader.create_revision != self.term.epoch:
            self._step_down(Why.KEY_REPLACED)
            return
        target = yield_to(me, self.view.nodes, self._seen, now, self._ttl, self._unhealthy_since)
        if target is not None:
            self._step_down(Why.YIELD, target)
            await self.etcd.delete_if_created(self.spec.leader_key, self.term.epoch)

    async def _resume(self, key: KeyValue, now: float, me: NodeInfo) -> bool:
        """Lead again in the term that lapsed, on its own key, after a renewal came
        through: etcd's raft leader changing stalls renewals past the hold but keeps the
        lease, so the key outlives the term and no other node could have won. The put
        moves the key's mod revision, and a follower frees a stopped leader's key only if
        it is unchanged since before the TTL reading that proved the stop
        (`_expire_leader`): so either that delete lands first and this put fails, or
        this put lands first and the delete fails. Until a renewal comes through the key
        is left as it is (it expires with the lease if none does). False: not
        resumable, the key is to be cleared."""
        lapsed = self._lapsed
        renewed = self._renewed_at
        if lapsed is None or key.create_revision != lapsed.epoch or not me.healthy:
            return False
        if renewed + self._hold_s <= now:
            return True  # no fresh renewal yet
        done, kv = await self.etcd.put_if_unchanged(
            self.spec.leader_key, self.spec.node.encode(), key.mod_revision, lease=self.lease
        )
        if not done or kv is None:
            return True  # changed under it: the watch brings the key as it now is
        self._lapsed = None
        self.term = Term(lapsed.epoch, renewed, self._hold_s)
        self.view.leader = kv
        self._set(Event.RESUMED)
        return True

    async def _campaign(self) -> None:
        sent = self.clock()
        created, kv = await self.etcd.put_if_absent(
            self.spec.leader_key, self.spec.node.encode(), lease=self.lease
        )
        if created and kv.lease == self.lease:
            self._lapsed = None
            self.term = Term(kv.create_revision, min(self._renewed_at, sent), self._hold_s)
            self.view.leader = kv
            self._set(Event.WON)
