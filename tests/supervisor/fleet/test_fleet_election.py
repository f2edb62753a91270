"""The cluster election against a real etcd on loopback (no mocks): one leader, rising
epochs, step-down before the lease can expire, priority, and the refusals."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest

from holdfast_contract.wire import free_port
from supervisor.errors import PolicyError
from supervisor.fleet.decide import NodeInfo, Term, may_campaign, yield_to
from supervisor.fleet.election import DuplicateNode, Elector, FingerprintMismatch
from supervisor.fleet.errors import LeaseLost
from supervisor.fleet.etcd import EtcdClient, EtcdUnavailable
from supervisor.fleet.node import OWN_NAME
from supervisor.fleet.registry import register
from supervisor.fleet.roles import ROLE, Change, Event, Role, StepDown, Why
from supervisor.fleet_spec import ClusterSpec, parse_cluster
from supervisor.states import IllegalTransition
from tests.fleet_etcd import Etcd

DEADLINE = 60.0  # generous: two shared cores; what is checked is order, not speed


def spec(endpoint: str, node: str, *, cluster: str = "c", priority: int = 0) -> ClusterSpec:
    return ClusterSpec(cluster, [endpoint], node, 2, priority)


@asynccontextmanager
async def elector(s: ClusterSpec, fingerprint: str = "fp-1", **kw: Any) -> AsyncIterator[Elector]:
    async with (
        EtcdClient(s.etcd, timeout_s=s.renew_s) as client,
        Elector(client, s, fingerprint, **kw) as e,
    ):
        yield e


def leaders(electors: list[Elector]) -> list[str]:
    return [e.spec.node for e in electors if e.is_leader()]


# the policy section


def test_cluster_section_absent_is_single_node() -> None:
    assert parse_cluster(None, 0.2) is None


def test_ttl_shorter_than_heartbeat_window_is_refused() -> None:
    data = {"name": "c", "etcd": ["127.0.0.1:2379"], "node": "n1", "ttl_s": 1}
    with pytest.raises(PolicyError) as err:
        parse_cluster(data, miss_window_s=1.5)
    assert "$.cluster.ttl_s: 1 s is not longer than the heartbeat miss window" in str(err.value)
    assert parse_cluster(data, miss_window_s=0.2) == ClusterSpec("c", ["127.0.0.1:2379"], "n1", 1)


def test_cluster_errors_name_the_key() -> None:
    with pytest.raises(PolicyError) as err:
        parse_cluster({"name": "c", "etcd": ["x"], "node": "n1", "ttl_s": "2"}, 0.2)
    assert err.value.errors == ["$.cluster.ttl_s: expected int, got str"]
    with pytest.raises(PolicyError) as err:
        parse_cluster({"name": "a/b", "etcd": ["nohost"], "node": "n1", "ttl_s": 0}, 0.2)
    assert err.value.errors[0].startswith("$.cluster.name: 'a/b' must be")
    assert "$.cluster.etcd[0]: 'nohost' is not HOST:PORT or http://HOST:PORT" in err.value.errors
    assert "$.cluster.ttl_s: got 0, must be at least 1 (seconds)" in err.value.errors
    with pytest.raises(PolicyError) as err:
        parse_cluster({"etcd": ["h:1"], "node": "n1"}, 0.2)
    assert err.value.errors == ["$.cluster: object missing required field name"]
    with pytest.raises(PolicyError) as err:
        parse_cluster({"name": "c", "etcd": ["h:1"], "node": "n1", "tll_s": 2}, 0.2)
    assert err.value.errors == ["$.cluster: object contains unknown field tll_s"]


# the decisions, on a clock the test sets


def test_term_holds_until_ttl_minus_margin() -> None:
    s = ClusterSpec("c", ["h:1"], "n1", ttl_s=2)
    term = Term(epoch=7, renewed_at=100.0, hold_s=s.hold_s)
    assert s.hold_s == 1.5 and s.renew_s == 0.5
    assert term.holds(101.49)
    assert not term.holds(101.5)  # the lease cannot expire before 102.0: 0.5 s to spare
    assert not term.holds(1e9)


def test_priority_rules() -> None:
    a, b = NodeInfo("a", "fp", priority=0), NodeInfo("b", "fp", priority=5)
    nodes = {"a": a, "b": b}
    assert may_campaign(b, nodes, vacant_since=10.0, now=10.0, wait_s=2.0)
    assert not may_campaign(a, nodes, vacant_since=10.0, now=11.9, wait_s=2.0)
    assert may_campaign(a, nodes, vacant_since=10.0, now=12.0, wait_s=2.0)  # b is stuck
    sick = {"a": a, "b": msgspec.structs.replace(b, healthy=False)}
    assert may_campaign(a, sick, vacant_since=10.0, now=10.0, wait_s=2.0)
    assert not may_campaign(msgspec.structs.replace(a, healthy=False), {}, 0.0, 99.0, 2.0)
    assert yield_to(a, nodes, {"b": 10.0}, now=11.0, wait_s=2.0) is None  # b just came up
    assert yield_to(a, nodes, {"b": 10.0}, now=12.0, wait_s=2.0) == "b"
    assert yield_to(b, nodes, {"a": 0.0}, now=99.0, wait_s=2.0) is None
    assert yield_to(a, sick, {"b": 0.0}, now=99.0, wait_s=2.0) is None
    # a leader whose pool is not whole hands over to any healthy node, once it has stayed so
    even = {"a": a, "c": NodeInfo("c", "fp", priority=0)}
    assert yield_to(a, even, {"c": 0.0}, now=99.0, wait_s=2.0) is None
    assert yield_to(a, even, {"c": 0.0}, now=99.0, wait_s=2.0, unhealthy_since=98.0) is None
    assert yield_to(a, even, {"c": 0.0}, now=99.0, wait_s=2.0, unhealthy_since=97.0) == "c"


def test_roles_move_only_through_the_table() -> None:
    assert ROLE.lookup(Role.FOLLOWER, Event.WON).dst is Role.LEADER
    where = "no row in supervisor/fleet/roles.py"
    with pytest.raises(IllegalTransition, match=f"'won' from starting: {where}"):
        ROLE.lookup(Role.STARTING, Event.WON)
    with pytest.raises(IllegalTransition, match="'leader' from leader: no row"):
        ROLE.lookup(Role.LEADER, Event.LEADER)  # reported, never a move
    assert {r.dst for r in ROLE.rows} | {Role.STARTING} == set(Role)
    assert ROLE.events() == set(Event) - {Event.LEADER}
    assert all(hasattr(Elector, r.action) for r in ROLE.rows), ROLE.rows


def test_changes_are_published_under_the_names_they_had() -> None:
    assert [str(e) for e in (Event.WON, Event.SESSION_LOST)] == ["won", "session_lost"]
    stale = StepDown(1.0, Why.RENEWAL_STALE, 2.5)
    assert (str(stale), stale.reason, stale.lapsed) == (
        "stepped_down.renewal_stale",
        "renewal_stale",
        True,
    )
    handed = StepDown(1.0, Why.YIELD, 2.5, to="n2")
    assert (f"fleet.{handed}", handed.reason, handed.lapsed) == (
        "fleet.stepped_down.yield_to_n2",
        "yield_to_n2",
        False,
    )
    # those the node publishes under their own names, as the event names they have always been
    assert {str(change): name.value for change, name in OWN_NAME.items()} == {
        "joined": "joined",
        "stop": "stop",
    }


# against etcd


def test_one_leader_among_three(etcd: Etcd) -> None:
    async def main() -> None:
        seen: list[list[str]] = []

        def check(e: Elector, event: Change) -> None:
            seen.append(leaders(group))

        group: list[Elector] = []
        async with AsyncExitStack() as stack:
            for n in ("n1", "n2", "n3"):
                group.append(
                    await stack.enter_async_context(
                        elector(spec(etcd.endpoint, n), on_change=check)
                    )
                )
            await group[0].wait_for(lambda e: e.view.leader_node is not None, DEADLINE)
            winner = group[0].view.leader_node
            for e in group:
                # the winner's own watch may bring its key before its campaign's reply
                # does: it counts once it has moved to leader, the others once they follow
                await e.wait_for(
                    lambda e: (
                        e.view.leader_node == winner
                        and (e.is_leader() if e.spec.node == winner else e.role != Role.STARTING)
                    ),
                    DEADLINE,
                )
            assert leaders(group) == [winner]
            assert {e.epoch for e in group if e.spec.node == winner} != {0}
        assert all(len(now) <= 1 for now in seen), seen

    asyncio.run(main())


def test_epoch_rises_with_each_new_leader(etcd: Etcd) -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            group = [
                (n, await stack.enter_async_context(elector(spec(etcd.endpoint, n))))
                for n in ("n1", "n2", "n3")
            ]
            epochs = []
            live = dict(group)
            while live:
                await next(iter(live.values())).wait_for(
                    lambda e: any(x.is_leader() for x in live.values()), DEADLINE
                )
                (name,) = [n for n, e in live.items() if e.is_leader()]
                epochs.append(live[name].epoch)
                await live.pop(name).__aexit__(None, None, None)  # leaves: revokes its lease
            assert epochs == sorted(epochs) and len(set(epochs)) == 3, epochs

    asyncio.run(main())


def test_leader_steps_down_before_its_lease_can_expire(etcd: Etcd) -> None:
    events: list[str] = []

    def seen(e: Elector, event: Change) -> None:
        events.append(f"{e.spec.node}:{event}")

    async def main() -> None:
        async with (
            elector(spec(etcd.endpoint, "n1"), on_change=seen) as a,
            elector(spec(etcd.endpoint, "n2"), on_change=seen) as b,
        ):
            await a.wait_for(lambda e: a.is_leader() or b.is_leader(), DEADLINE)
            leader = a if a.is_leader() else b
            first = leader.epoch
            etcd.stop()  # etcd answers nothing: no renewal succeeds
            try:
                await leader.wait_for(lambda e: e.role is Role.FOLLOWER, DEADLINE)
                down = leader.stepdowns[-1]
                assert down.why is Why.RENEWAL_STALE
                assert down.at < down.lease_deadline - leader.spec.margin_s / 2
                assert not a.is_leader() and not b.is_leader()
                # past the lease's own deadline the session is given up for a new one
                await leader.wait_for(lambda e: e.failures != [], DEADLINE)
                assert "expired unrenewed" in leader.failures[0][1]
            finally:
                etcd.cont()
            await a.wait_for(lambda e: a.is_leader() or b.is_leader(), DEADLINE)
            now = a if a.is_leader() else b
            # a new term; or, where etcd kept the lease alive through its stop (the stop
            # was shorter than the lease's TTL in etcd's own clock), the same term resumed
            resumed = now is leader and f"{leader.spec.node}:resumed" in events
            assert now.epoch > first or (now.epoch == first and resumed), events

    asyncio.run(main())


def test_leader_is_not_leader_past_its_hold_on_its_own_clock(etcd: Etcd) -> None:
    """is_leader() reads the clock at each call: once the last renewal is older than
    hold_s, no flag or pending renewal keeps it true."""
    skew = [0.0]

    def clock() -> float:
        return time.monotonic() + skew[0]

    async def main() -> None:
        async with elector(spec(etcd.endpoint, "n1"), clock=clock) as a:
            await a.wait_for(Elector.is_leader, DEADLINE)
            assert a.term is not None
            # the clock jumps past the hold of every renewal sent so far, in flight or not
            skew[0] = 2.0 * a.spec.ttl_s
            assert not a.is_leader()  # at once, before the elector's loop runs again
            await a.wait_for(lambda e: e.stepdowns != [], DEADLINE)
            # for want of a fresh renewal: stale by the loop's own check, or late when the
            # renewal in flight at the jump is answered first (either may come first)
            assert a.stepdowns[0].lapsed, a.stepdowns

    asyncio.run(main())


def test_a_lapsed_leader_resumes_its_term_on_its_own_key(etcd: Etcd) -> None:
    """A leader whose renewals came too late (its clock jumps past its hold, as when
    etcd's raft leader changes and renewals stall) steps down; once a renewal comes
    through its key is still there, so it leads again in the same term, and the follower
    never campaigns: no new term, and never two leaders."""
    skew = [0.0]

    def clock() -> float:
        return time.monotonic() + skew[0]

    async def main() -> None:
        both: list[Elector] = []
        overlaps: list[list[str]] = []
        events: list[str] = []

        def seen(e: Elector, event: Change) -> None:
            events.append(f"{e.spec.node}:{event}")
            if len(leaders(both)) > 1:
                overlaps.append(leaders(both))

        async with elector(spec(etcd.endpoint, "n1"), clock=clock, on_change=seen) as a:
            both.append(a)
            await a.wait_for(Elector.is_leader, DEADLINE)
            term = a.epoch
            async with elector(spec(etcd.endpoint, "n2"), on_change=seen) as b:
                both.append(b)
                await b.wait_for(lambda e: e.view.leader_node == "n1", DEADLINE)
                key = b.view.leader
                assert key is not None
                skew[0] = 2.0 * a.spec.ttl_s
                assert not a.is_leader()
                await a.wait_for(lambda e: e.stepdowns != [], DEADLINE)
                assert a.stepdowns[0].lapsed, a.stepdowns  # stale or late, as above
                await a.wait_for(Elector.is_leader, DEADLINE)
                assert a.epoch == term and "n1:resumed" in events, events
                # the put that resumed moved the key: a follower's delete conditional on
                # the version it read before cannot free it any more
                assert not await b.etcd.delete_if_unchanged(a.spec.leader_key, key.mod_revision)
                start = b.renewals  # and the follower stays one through a whole TTL
                await b.wait_for(lambda e: e.renewals >= start + 4, DEADLINE)
                assert a.is_leader() and a.epoch == term and b.cluster_epoch == term
                assert b.role is Role.FOLLOWER and b.term is None
        assert overlaps == []
        assert [d.reason for d in a.stepdowns] == ["renewal_stale", "stop"]

    asyncio.run(main())


def test_conditional_put_and_delete_follow_the_keys_version(etcd: Etcd) -> None:
    async def main() -> None:
        async with EtcdClient([etcd.endpoint]) as raw:
            lease, _ = await raw.grant(5)
            await raw.put("/t/k", b"a", lease=lease)
            first = await raw.get("/t/k")
            assert first is not None
            done, kv = await raw.put_if_unchanged("/t/k", b"a", first.mod_revision, lease=lease)
            assert done and kv is not None and kv.mod_revision > first.mod_revision
            assert kv.create_revision == first.create_revision and kv.lease == lease
            assert not await raw.delete_if_unchanged("/t/k", first.mod_revision)
            assert await raw.get("/t/k") == kv
            assert await raw.delete_if_unchanged("/t/k", kv.mod_revision)
            assert await raw.put_if_unchanged("/t/k", b"b", kv.mod_revision) == (False, None)
            await raw.put("/t/n", b"x", lease=lease)
            assert not await raw.delete_if_leased("/t/n", lease + 1)
            assert await raw.delete_if_leased("/t/n", lease)
            assert await raw.get("/t/n") is None

    asyncio.run(main())


def test_rejoining_node_of_equal_priority_stays_follower(etcd: Etcd) -> None:
    async def main() -> None:
        async with elector(spec(etcd.endpoint, "n1")) as a:
            await a.wait_for(Elector.is_leader, DEADLINE)
            async with elector(spec(etcd.endpoint, "n2")) as b:
                await b.wait_for(
                    lambda e: e.role is Role.FOLLOWER and e.view.leader_node == "n1", DEADLINE
                )
            async with elector(spec(etcd.endpoint, "n2")) as b:  # rejoins
                await b.wait_for(
                    lambda e: e.role is Role.FOLLOWER and "n1" in e.view.nodes, DEADLINE
                )
                # leadership must not move while the rejoined node renews its lease through
                # three whole TTLs (counted in renewals, four per TTL, not in seconds)
                start = b.renewals
                await b.wait_for(lambda e: e.renewals >= start + 12, DEADLINE)
                assert a.is_leader() and not b.is_leader() and b.stepdowns == []

    asyncio.run(main())


def test_higher_priority_node_is_handed_leadership(etcd: Etcd) -> None:
    async def main() -> None:
        both: list[Elector] = []
        overlaps: list[list[str]] = []

        def check(e: Elector, event: Change) -> None:
            if len(leaders(both)) > 1:
                overlaps.append(leaders(both))

        async with elector(spec(etcd.endpoint, "low"), on_change=check) as low:
            both.append(low)
            await low.wait_for(Elector.is_leader, DEADLINE)
            first = low.epoch
            async with elector(spec(etcd.endpoint, "high", priority=5), on_change=check) as high:
                both.append(high)
                await high.wait_for(Elector.is_leader, DEADLINE)
                assert high.epoch > first
                assert [d.reason for d in low.stepdowns] == ["yield_to_high"]
                assert low.role is Role.FOLLOWER
            await low.wait_for(Elector.is_leader, DEADLINE)  # high left: low leads again
        assert overlaps == []

    asyncio.run(main())


def test_unhealthy_node_does_not_campaign(etcd: Etcd) -> None:
    async def main() -> None:
        async with elector(spec(etcd.endpoint, "n1"), healthy=False) as a:
            await a.wait_for(lambda e: e.role is Role.FOLLOWER and "n1" in e.view.nodes, DEADLINE)
            start = a.renewals  # nobody leads through two whole TTLs of its renewals
            await a.wait_for(lambda e: e.renewals >= start + 8, DEADLINE)
            assert not a.is_leader() and a.view.leader is None
            a.set_healthy(True)
            await a.wait_for(Elector.is_leader, DEADLINE)

    asyncio.run(main())


def test_leader_whose_pool_stays_broken_hands_over(etcd: Etcd) -> None:
    async def main() -> None:
        async with elector(spec(etcd.endpoint, "n1")) as a:
            await a.wait_for(Elector.is_leader, DEADLINE)
            async with elector(spec(etcd.endpoint, "n2")) as b:
                await b.wait_for(lambda e: e.view.leader_node == "n1", DEADLINE)
                a.set_healthy(False)
                await b.wait_for(Elector.is_leader, DEADLINE)
                assert [d.reason for d in a.stepdowns] == ["yield_to_n2"]
                assert not a.is_leader()

    asyncio.run(main())


def test_leader_key_deleted_behind_its_back_steps_it_down(etcd: Etcd) -> None:
    async def main() -> None:
        async with elector(spec(etcd.endpoint, "n1")) as a:
            await a.wait_for(Elector.is_leader, DEADLINE)
            first = a.epoch
            async with EtcdClient([etcd.endpoint]) as raw:
                await raw.delete(a.spec.leader_key)
            await a.wait_for(lambda e: len(e.stepdowns) == 1, DEADLINE)
            assert a.stepdowns[0].why is Why.KEY_GONE
            await a.wait_for(Elector.is_leader, DEADLINE)  # and campaigns again
            assert a.epoch > first

    asyncio.run(main())


def test_duplicate_node_name_is_refused_naming_the_first(etcd: Etcd) -> None:
    async def main() -> None:
        async with elector(spec(etcd.endpoint, "n1")) as first:
            await first.wait_for(Elector.is_leader, DEADLINE)
            async with elector(spec(etcd.endpoint, "n1")) as second:
                with pytest.raises(DuplicateNode) as err:
                    await second.wait_for(lambda e: e.role is Role.FOLLOWER, DEADLINE)
                assert second.role is Role.FAILED and not second.is_leader()
            info = first.view.nodes["n1"]
            assert f"node name 'n1' is held by a live supervisor (pid {info.pid}" in str(err.value)
            assert "cluster.node" in str(err.value)
            assert first.is_leader()

    asyncio.run(main())


def test_a_name_held_by_a_lease_the_node_gave_up_is_its_own(etcd: Etcd) -> None:
    """After renewals stalled past the TTL (an etcd leader change can keep the lease
    alive meanwhile), the node's name is still registered on its old lease: the node
    revokes that lease and registers again, instead of refusing itself."""

    async def main() -> None:
        s = spec(etcd.endpoint, "n1")
        me = NodeInfo("n1", "fp-1", 0, True, 4242, "host-a", "", "")
        async with EtcdClient(s.etcd, timeout_s=s.renew_s) as client:
            old, _ = await client.grant(60)
            await register(client, s, me, old, time.monotonic, 0.0)
            new, _ = await client.grant(60)
            with pytest.raises(DuplicateNode):  # a lease that is not its own: refused
                await register(client, s, me, new, time.monotonic, 0.0)
            given_up = {old}
            await register(client, s, me, new, time.monotonic, 0.0, given_up)
            kv = await client.get(s.node_key("n1"))
            assert kv is not None and kv.lease == new
            assert given_up == set()
            with pytest.raises(LeaseLost):
                await client.keepalive(old)

    asyncio.run(main())


def test_fingerprint_mismatch_is_refused_naming_both(etcd: Etcd) -> None:
    async def main() -> None:
        async with elector(spec(etcd.endpoint, "n1"), "fp-aaa") as first:
            await first.wait_for(Elector.is_leader, DEADLINE)
            async with elector(spec(etcd.endpoint, "n2"), "fp-bbb") as second:
                with pytest.raises(FingerprintMismatch) as err:
                    await second.wait_for(lambda e: e.role is Role.FOLLOWER, DEADLINE)
            message = str(err.value)
            assert "fp-aaa" in message and "fp-bbb" in message and "'n1'" in message
            assert "cluster.name" in message
            assert "n2" not in first.view.nodes

    asyncio.run(main())


def test_unreachable_etcd_is_retried_with_backoff(tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{free_port()}"  # nothing listens there

    async def main() -> None:
        async with elector(spec(endpoint, "n1"), max_backoff_s=0.8) as a:
            await a.wait_for(lambda e: len(e.failures) >= 5, DEADLINE)
            assert not a.is_leader() and a.role is Role.STARTING
            times = [t for t, _ in a.failures]
            gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
            assert gaps[-1] > gaps[0], gaps  # backing off
            assert f"etcd unreachable within 0.50 s: http://{endpoint}" in a.failures[0][1]
            assert "check cluster.etcd" in a.failures[0][1]
            port = int(endpoint.rsplit(":", 1)[1])
            server = await asyncio.to_thread(Etcd, tmp_path, port)  # etcd comes up late
            try:
                await a.wait_for(Elector.is_leader, DEADLINE)
            finally:
                server.kill()

    asyncio.run(main())


def test_client_errors_name_the_endpoints() -> None:
    async def main() -> None:
        dead = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
        async with EtcdClient(dead, timeout_s=2.0) as client:
            with pytest.raises(EtcdUnavailable) as err:
                await client.get("/x")
        assert all(d in str(err.value) for d in dead)

    asyncio.run(main())
