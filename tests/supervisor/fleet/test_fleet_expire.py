"""A follower frees the key of a leader that stopped renewing at that leader's own deadline,
from etcd's TTL readings, instead of waiting for etcd to expire the lease: the rule
(`decide.early_revoke`) table by table and as a property over generated timings, then
against a real etcd with the leader cut off behind a relay that stops passing bytes."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.fleet.decide import LeaseReading, early_revoke, unrenewed
from supervisor.fleet.election import GUARD_S, Elector
from supervisor.fleet.roles import Change, Event, Role
from supervisor.fleet_spec import ClusterSpec
from tests.fleet_etcd import Etcd
from tests.supervisor.fleet.test_fleet_election import elector, spec

DEADLINE = 60.0  # generous: two shared cores; what is checked is order, not speed
HOLD = 1.5  # ttl_s 2: the leader serves 1.5 s after it sent its last renewal
LEASE = 7


def reading(at: float, ttl: int, *, lease: int = LEASE, rtt: float = 0.002) -> LeaseReading:
    return LeaseReading(lease, at, at + rtt, ttl, 2)


def run(readings: list[LeaseReading], hold: float = HOLD) -> list[bool]:
    first: LeaseReading | None = None
    out = []
    for r in readings:
        first, due = early_revoke(first, r, hold, GUARD_S)
        out.append(due)
    return out


# the rule, table by table


def test_a_leader_that_renews_is_never_revoked() -> None:
    # renewing every 0.5 s keeps more than 1.5 s remaining: every reading says 1
    assert not any(run([reading(i * 0.1, 1) for i in range(100)]))


def test_a_silent_leader_is_revoked_once_its_hold_has_passed() -> None:
    # last renewal processed at 0.0: remaining < 1 s from 1.0 on
    readings = [reading(0.9, 1), reading(1.0, 0), reading(1.4, 0), reading(1.56, 0)]
    assert run(readings) == [False, False, False, True]


def test_a_renewal_between_the_readings_starts_over() -> None:
    readings = [reading(1.0, 0), reading(1.3, 1), reading(1.56, 0), reading(1.9, 0)]
    assert run(readings) == [False, False, False, False]


def test_readings_too_far_apart_prove_nothing() -> None:
    # a renewal processed between 1.0 and 2.3 could have run out again: no revoke at 2.3
    assert run([reading(1.0, 0), reading(2.3, 0)]) == [False, False]


def test_without_a_published_hold_etcd_expires_the_lease() -> None:
    assert not any(run([reading(1.0, 0), reading(1.6, 0), reading(1.9, 0)], hold=0.0))


def test_a_gone_lease_or_another_lease_starts_over() -> None:
    assert run([reading(1.0, 0), reading(1.6, -1), reading(1.7, 0)]) == [False] * 3
    assert run([reading(1.0, 0), reading(1.6, 0, lease=8), reading(1.8, 0, lease=8)]) == [
        False,
        False,
        False,
    ]


def test_unrenewed_reads_the_rounding_down() -> None:
    assert unrenewed(reading(1.0, 0), reading(1.5, 0))
    assert not unrenewed(reading(1.0, 0), reading(1.5, 1))


# the rule as a property: whenever it says revoke, the holder has stopped serving


@settings(max_examples=400, deadline=None)
@given(
    sends=st.lists(st.floats(0.0, 1.6), min_size=1, max_size=8),  # gaps: stalls too
    delays=st.lists(st.floats(0.0, 0.3), min_size=8, max_size=8),  # send -> processed
    reads=st.lists(st.floats(0.01, 0.3), min_size=5, max_size=60),  # gaps between reads
    rtts=st.lists(st.floats(0.0, 0.05), min_size=60, max_size=60),
)
def test_a_revoke_never_comes_before_the_holders_deadline(
    sends: list[float], delays: list[float], reads: list[float], rtts: list[float]
) -> None:
    granted = 2
    sent, t = [], 0.0
    for gap in sends:
        t += gap
        sent.append(t)
    processed = [s + d for s, d in zip(sent, delays, strict=False)]

    def remaining(at: float) -> int:
        last = max((p for p in processed if p <= at), default=None)
        if last is None or last + granted <= at:
            return -1
        return math.floor(last + granted - at)

    first: LeaseReading | None = None
    at = 0.0
    for gap, rtt in zip(reads, rtts, strict=False):
        at += gap
        evaluated = at + rtt / 2  # etcd computes the TTL somewhere between send and answer
        now = LeaseReading(LEASE, at, at + rtt, remaining(evaluated), granted)
        first, due = early_revoke(first, now, HOLD, GUARD_S)
        if due:
            # every renewal etcd had processed by then: the holder serves until s + HOLD
            deadline = max(
                s + HOLD for s, p in zip(sent, processed, strict=False) if p <= evaluated
            )
            assert deadline <= now.sent, (deadline, now)
            return


# against a real etcd


class Relay:
    """Loopback TCP relay to etcd that can stop passing bytes both ways without closing
    anything: what a node cut off by a network partition sees."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.open = asyncio.Event()
        self.open.set()
        self.endpoint = ""
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> Relay:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.endpoint = f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection(*self.target)
        pumps = [
            asyncio.create_task(self._pump(reader, up_w)),
            asyncio.create_task(self._pump(up_r, writer)),
        ]
        self._tasks.update(pumps)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(65536):
                await self.open.wait()
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(OSError, RuntimeError):
                dst.close()


def test_a_cut_off_leader_is_replaced_at_its_own_deadline(etcd: Etcd) -> None:
    """The leader's etcd traffic stops: it steps down at its hold, the follower revokes
    its lease from the TTL readings and wins; at no change do two nodes lead."""

    async def main() -> None:
        changes: list[tuple[str, Change, list[str]]] = []
        group: list[Elector] = []

        def seen(e: Elector, event: Change) -> None:
            changes.append((e.spec.node, event, [x.spec.node for x in group if x.is_leader()]))

        async with (
            Relay(etcd.endpoint) as relay,
            elector(spec(relay.endpoint, "n1"), on_change=seen) as a,
        ):
            group.append(a)
            await a.wait_for(Elector.is_leader, DEADLINE)
            async with elector(spec(etcd.endpoint, "n2"), on_change=seen) as b:
                group.append(b)
                await b.wait_for(lambda e: e.view.leader_node == "n1", DEADLINE)
                lease = a.lease
                relay.open.clear()  # n1 is cut off from etcd
                await b.wait_for(Elector.is_leader, DEADLINE)
                assert [r[1] for r in b.freed] == [lease]
                reasons = [d.reason for d in a.stepdowns]
                assert reasons[:1] == ["renewal_stale"], reasons
                stepped = a.stepdowns[0].at
                assert stepped <= b.freed[0][0], (stepped, b.freed)
                relay.open.set()  # n1 is back: it stays a follower of n2
                await a.wait_for(
                    lambda e: e.role == Role.FOLLOWER and e.view.leader_node == "n2",
                    DEADLINE,
                )
                assert b.is_leader() and not a.is_leader()
        assert changes, "no change was reported"
        assert all(len(leading) <= 1 for _, _, leading in changes), changes

    asyncio.run(main())


def test_a_lease_that_outlived_its_stalled_renewals_is_taken_up_again(etcd: Etcd) -> None:
    """No renewal comes through for the lease's TTL on the node's clock while etcd keeps
    the lease (as through etcd's own raft election): the node gives the session up
    without revoking the lease, takes the same lease up again once etcd answers, and
    resumes its term on its key: no new term. (TTL 8 s: etcd's lease outlives the stall
    by seconds, whatever the machine's load.)"""
    skew = [0.0]

    def clock() -> float:
        return time.monotonic() + skew[0]

    async def main() -> None:
        events: list[Change] = []
        async with Relay(etcd.endpoint) as relay:
            s = ClusterSpec("c", [relay.endpoint], "n1", 8)
            async with elector(s, clock=clock, on_change=lambda e, ev: events.append(ev)) as a:
                await a.wait_for(Elector.is_leader, DEADLINE)
                term, lease = a.epoch, a.lease
                relay.open.clear()  # etcd answers nothing ...
                skew[0] = 2.0 * s.ttl_s  # ... for longer than the TTL, on the node's clock
                await a.wait_for(lambda e: e.failures != [], DEADLINE)
                assert "expired unrenewed" in a.failures[0][1]
                assert not a.is_leader()
                relay.open.set()
                await a.wait_for(Elector.is_leader, DEADLINE)
                assert a.lease == lease and a.epoch == term
                assert events.count(Event.WON) == 1 and Event.RESUMED in events, events
                assert [d.reason for d in a.stepdowns] == ["renewal_stale"]

    asyncio.run(main())
