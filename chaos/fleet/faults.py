"""Fleet faults, shared by bench/fleet.py and the chaos suite (chaos/scenarios/fleet.yaml).

Each takes the running fleet, injects one fault, waits for the fleet to be whole again
(the victim back as a follower) and returns what the response log and the nodes showed.
Every wait has a deadline; the only waits on the clock are a fault's own `hold_s` (how long
a partition, an outage or a SIGSTOP lasts) and, after a rejoin, the window in which a
leader would hand over to a node it has seen healthy for ttl_s (it must not, at equal
priority).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import msgspec

from chaos.fleet import analysis
from chaos.fleet.harness import FleetRun
from chaos.fleet.load import REQUEST_TIMEOUT_S, Row
from chaos.fleet.net import FleetError

SLACK_S = 10.0  # on top of ttl_s-derived deadlines: two busy cores, etcd's own expiry check


class FleetTrial(msgspec.Struct):
    kind: str
    index: int
    victim: str
    injected: float  # CLOCK_MONOTONIC
    old_leader: str
    old_epoch: int
    ended: float = 0.0
    new_leader: str = ""
    new_epoch: int = 0
    failover_ms: float | None = None  # fault -> first answer of a newer epoch, surviving router
    stopped_serving_ms: float | None = None  # fault -> last answer under the old epoch
    stepped_down_ms: float | None = None  # fault -> the victim no longer says it leads
    serve_again_ms: float | None = None  # etcd back -> first answer
    rejoin_ms: float | None = None  # restart / reconnect / SIGCONT -> a follower of the leader
    leader_kept: bool | None = None  # the rejoined node did not take leadership back
    leader_changes: int = 0  # newer epochs answering during the trial
    requests: int = 0  # answered during the trial, every client
    failed_requests: int = 0  # clients of surviving routers
    failed_elsewhere: int = 0  # clients of the victim's router (dead, cut off, stopped)
    overlap_ms: float = 0.0
    shared_epochs: int = 0  # cluster epochs answered by more than one node
    own_cache: bool | None = None  # kill-node: the restarted node serves from its own daemon
    etcd_leader: bool | None = None  # kill-etcd-member: the member killed led etcd's raft
    note: str = ""


class Ctx(msgspec.Struct):
    run: FleetRun
    hold_s: float
    observe_s: float  # after a rejoin: how long the leader must stay put

    @property
    def ttl_s(self) -> int:
        return self.run.opts.ttl_s


def _begin(ctx: Ctx, kind: str, index: int, victim: str | None = None) -> tuple[FleetTrial, int]:
    leader, epoch = ctx.run.steady(ctx.ttl_s * 3 + SLACK_S)
    trial = FleetTrial(kind, index, victim or leader, 0.0, leader, epoch)
    return trial, ctx.run.clients.mark()


def _newer(ctx: Ctx, trial: FleetTrial, mark: int, routers: set[str]) -> Row:
    row = ctx.run.clients.wait(
        lambda r: r.ok and r.router in routers and r.cluster_epoch > trial.old_epoch,
        ctx.ttl_s * 3 + SLACK_S + REQUEST_TIMEOUT_S,  # clients stuck on the old leader time out
        after=mark,
    )
    if row is None:
        raise FleetError(f"{trial.kind}: no answer of an epoch after {trial.old_epoch} in time")
    trial.failover_ms = analysis.ms(trial.injected, row.answered)
    trial.new_leader, trial.new_epoch = row.node, row.cluster_epoch
    return row


def _finish(ctx: Ctx, trial: FleetTrial, mark: int, victim_routers: set[str]) -> FleetTrial:
    rows = ctx.run.clients.since(mark)
    survivors = {r.router for r in rows} - victim_routers
    trial.ended = time.monotonic()
    trial.requests = len(rows)
    trial.failed_requests = len(analysis.failed(rows, survivors))
    trial.failed_elsewhere = len(analysis.failed(rows, victim_routers))
    trial.overlap_ms = analysis.overlap_ms(rows)
    nodes = analysis.epoch_nodes(rows)
    trial.shared_epochs = sum(1 for names in nodes.values() if len(names) > 1)
    trial.leader_changes = len({e for e in nodes if e > trial.old_epoch})
    return trial


def _hold_until(until: float) -> None:
    time.sleep(max(0.0, until - time.monotonic()))  # the fault's own duration


def _kept(ctx: Ctx, trial: FleetTrial) -> bool:
    """Whether the leader stays (new_leader, new_epoch) for observe_s: a leader hands over
    only to a node it has seen healthy for ttl_s, so that window must pass first."""
    end = time.monotonic() + ctx.observe_s
    while time.monotonic() < end:
        leader = ctx.run.steady(ctx.ttl_s * 3 + SLACK_S)
        if leader != (trial.new_leader, trial.new_epoch):
            trial.note += f" leader moved to {leader} after the rejoin;"
            return False
        time.sleep(0.1)  # polled: a node's view is only readable by asking its API
    return True


def kill_node(ctx: Ctx, index: int) -> FleetTrial:
    trial, _ = _begin(ctx, "kill-node", index)
    victim = ctx.run.nodes[trial.victim]
    ctx.run.pause_clients(victim.name)
    mark = ctx.run.clients.mark()
    trial.injected = victim.kill()
    _newer(ctx, trial, mark, set(ctx.run.nodes) - {victim.name})
    survivors = [n for n in ctx.run.nodes if n != victim.name]
    ctx.run.steady(ctx.ttl_s * 3 + SLACK_S, among=survivors)
    restarted = time.monotonic()
    victim.start()
    back = ctx.run.follower_of(victim.name, trial.new_leader, trial.new_epoch, 60 + SLACK_S)
    trial.rejoin_ms = analysis.ms(restarted, back)
    trial.own_cache = ctx.run.own_cache(victim.name)
    ctx.run.resume_clients(victim.name)
    trial.leader_kept = _kept(ctx, trial)
    return _finish(ctx, trial, mark, {victim.name})


def partition_node(ctx: Ctx, index: int) -> FleetTrial:
    trial, _ = _begin(ctx, "partition-node", index)
    name = trial.victim
    ctx.run.clients.pause(ctx.run.outside[name])  # its packets go nowhere: it would just wait
    mark = ctx.run.clients.mark()
    trial.injected = time.monotonic()
    ctx.run.fleet.isolate(name)
    try:
        deadline = trial.injected + ctx.ttl_s * 3 + SLACK_S
        while ctx.run.role_of(name) == "leader" and time.monotonic() < deadline:
            time.sleep(0.02)  # asked of its API from inside the cut-off namespace
        trial.stepped_down_ms = analysis.ms(trial.injected, time.monotonic())
        _newer(ctx, trial, mark, set(ctx.run.nodes) - {name})
        _hold_until(trial.injected + ctx.hold_s)
        old = [
            r for r in ctx.run.clients.since(mark) if r.ok and r.cluster_epoch == trial.old_epoch
        ]
        last = max((r.answered for r in old), default=None)
        trial.stopped_serving_ms = analysis.ms(trial.injected, last)
    finally:
        ctx.run.fleet.rejoin(name)
    rejoined = time.monotonic()
    back = ctx.run.follower_of(name, trial.new_leader, trial.new_epoch, ctx.ttl_s * 3 + SLACK_S)
    trial.rejoin_ms = analysis.ms(rejoined, back)
    ctx.run.clients.resume(ctx.run.outside[name])
    trial.leader_kept = _kept(ctx, trial)
    return _finish(ctx, trial, mark, {name})


def kill_etcd_member(ctx: Ctx, index: int) -> FleetTrial:
    """A member that follows in etcd's raft, and on every second trial the raft leader
    (etcd elects another: lease renewals wait for it)."""
    ctx.run.steady(ctx.ttl_s * 3 + SLACK_S)
    deadline = time.monotonic() + SLACK_S
    while (raft := ctx.run.fleet.etcd_leader()) is None:
        if time.monotonic() > deadline:
            raise FleetError(f"kill-etcd-member: etcd elected no raft leader in {SLACK_S:g} s")
        time.sleep(0.05)  # etcd's own election: only its status says when it is over
    ctx.run.etcd_kills += 1
    member = raft if ctx.run.etcd_kills % 2 == 0 else raft % 3 + 1
    trial, mark = _begin(ctx, "kill-etcd-member", index, victim=f"e{member}")
    trial.etcd_leader = member == raft
    trial.injected = time.monotonic()
    ctx.run.fleet.stop_member(member)
    try:
        _hold_until(trial.injected + ctx.hold_s)
    finally:
        ctx.run.fleet.start_member(member)
    trial.rejoin_ms = analysis.ms(trial.injected + ctx.hold_s, time.monotonic())
    trial.new_leader, trial.new_epoch = ctx.run.steady(ctx.ttl_s * 3 + SLACK_S)
    return _finish(ctx, trial, mark, set())


def kill_etcd_all(ctx: Ctx, index: int) -> FleetTrial:
    trial, mark = _begin(ctx, "kill-etcd-all", index, victim="e1+e2+e3")
    trial.injected = time.monotonic()
    ctx.run.fleet.stop_member(1, 2, 3)
    try:
        _hold_until(trial.injected + ctx.hold_s)
        ok = [r for r in ctx.run.clients.since(mark) if r.ok]
        trial.stopped_serving_ms = analysis.ms(
            trial.injected, max((r.answered for r in ok), default=None)
        )
        back = time.monotonic()
    finally:
        ctx.run.fleet.start_member(1, 2, 3)
    row = ctx.run.clients.wait(
        lambda r: r.ok and r.sent >= back, ctx.ttl_s * 3 + SLACK_S, after=mark
    )
    trial.serve_again_ms = analysis.ms(back, row.answered if row is not None else None)
    trial.new_leader, trial.new_epoch = ctx.run.steady(ctx.ttl_s * 3 + SLACK_S)
    trial.note = "requests fail while etcd is down and the lease has run out: by design"
    return _finish(ctx, trial, mark, set())


def pause_leader_supervisor(ctx: Ctx, index: int) -> FleetTrial:
    trial, _ = _begin(ctx, "pause-leader-supervisor", index)
    victim = ctx.run.nodes[trial.victim]
    pid = victim.pid
    if pid is None:
        raise FleetError(f"node {victim.name}'s supervisor is not running")
    ctx.run.pause_clients(victim.name)
    mark = ctx.run.clients.mark()
    trial.injected = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    try:
        _newer(ctx, trial, mark, set(ctx.run.nodes) - {victim.name})
        _hold_until(trial.injected + ctx.hold_s)
    finally:
        os.kill(pid, signal.SIGCONT)
    resumed = time.monotonic()
    back = ctx.run.follower_of(
        victim.name, trial.new_leader, trial.new_epoch, ctx.ttl_s * 3 + SLACK_S
    )
    trial.rejoin_ms = analysis.ms(resumed, back)
    ctx.run.resume_clients(victim.name)
    trial.leader_kept = _kept(ctx, trial)
    return _finish(ctx, trial, mark, {victim.name})


RUNNERS: dict[str, Callable[[Ctx, int], FleetTrial]] = {  # one per kinds.FLEET_FAULTS
    "kill-node": kill_node,
    "partition-node": partition_node,
    "kill-etcd-member": kill_etcd_member,
    "kill-etcd-all": kill_etcd_all,
    "pause-leader-supervisor": pause_leader_supervisor,
}
