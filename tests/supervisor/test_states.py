"""Every row of the engine and daemon transition tables, made by the method the row names
and published under the row's event; and moves outside the table refused. No processes:
fake process handles, a fake launcher and agents socket, the real event bus."""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest

import supervisor
from holdfast_contract.agent_protocol import Drain, Promote
from holdfast_contract.ready import DaemonReady
from supervisor.backoff import RestartBook
from supervisor.core import Crew
from supervisor.daemons import CacheDaemons
from supervisor.policy import RestartSpec
from supervisor.primary import Target
from supervisor.states import (
    DAEMON,
    ENGINE,
    DaemonState,
    EngineState,
    IllegalTransition,
    Row,
    Table,
    move,
)
from supervisor.units import Daemon, Engine, Incarnation
from supervisor.wiring import Term
from tests.supervisor_fakes import FakeProc, Rig, bus_at, policy, rig

E = EngineState
D = DaemonState
BATCH_ONLY = {E.BATCH, E.DRAINING, E.EVICTED}
SERVING_ONLY = {E.STANDBY, E.PRIMARY}
UPDATE_ROWS = {"superseded", "refitted"}  # a serving engine's, through draining


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(coro)


def label(row: Row[Any, Any]) -> str:
    return f"{row.src}-{row.event}-{row.dst}"


# ---- engines ----
def batch_row(row: Row[EngineState, str]) -> bool:
    # an update's superseded primary drains, and a refit's stands by again: serving rows
    return bool({row.src, row.dst} & BATCH_ONLY) and row.event not in UPDATE_ROWS


def usable(row: Row[EngineState, str], batch: bool) -> bool:
    if row.event in UPDATE_ROWS:
        return not batch
    other = SERVING_ONLY if batch else BATCH_ONLY
    return not ({row.src, row.dst} & other) and row.event != "stopped"


def path_to(state: EngineState, batch: bool) -> list[Row[EngineState, str]]:
    """The shortest run of table rows from dead to `state` for a serving or batch engine."""
    paths: dict[EngineState, list[Row[EngineState, str]]] = {E.DEAD: []}
    todo = collections.deque([E.DEAD])
    while todo:
        s = todo.popleft()
        for r in ENGINE.rows:
            if r.src == s and r.dst not in paths and usable(r, batch):
                paths[r.dst] = [*paths[s], r]
                todo.append(r.dst)
    return paths[state]


async def standby(g: Rig, besides: Engine) -> Engine:
    """Another serving engine, started and ready."""
    other = next(
        e for e in g.c.engines.values() if e.serving and e is not besides and e.state == E.DEAD
    )
    await g.c.spawn(other)
    assert other.inc is not None
    g.c.ready(other, other.inc)
    return other


def proc(e: Engine) -> FakeProc:
    assert e.inc is not None
    p = e.inc.procs[0]
    assert isinstance(p, FakeProc)
    return p


class Driver:
    """Makes one row happen to `e` through the Crew method the row names."""

    def __init__(self, g: Rig) -> None:
        self.g = g
        self.evicting: asyncio.Task[None] | None = None

    async def __call__(self, e: Engine, row: Row[EngineState, str]) -> None:
        c, ev = self.g.c, row.event
        inc = e.inc
        if ev == "starting":
            await c.spawn(e)
        elif ev == "quarantined" and row.action == "spawn":
            self.g.launcher.fail = "cannot exec /nonexistent/engine"
            await c.spawn(e)
            self.g.launcher.fail = ""
        elif ev in ("died", "quarantined"):
            assert inc is not None
            e.book.reset()
            for _ in range(c.policy.restart.max_restarts if ev == "quarantined" else 0):
                e.book.record()
            c.on_exit(e, inc, "rank 0 exited with -9")
        elif ev == "ready":
            assert inc is not None
            c.ready(e, inc)
        elif ev == "promoted":
            c.promote(e, time.monotonic(), cause="no-primary", old=None)
        elif ev == "epoch-raised":
            c.raise_epoch(c.epoch + 5, cluster_epoch=7)
        elif ev == "fenced":
            await c.hand_over(await standby(self.g, e))
        elif ev == "draining":
            proc(e).hold = True
            self.evicting = asyncio.ensure_future(c.evict(e, reason="load 9 > 8", held=False))
            await proc(e).terminating.wait()
        elif ev == "evicted" and row.src == E.DRAINING:
            await self.finish_eviction(e)
        elif ev == "evicted":
            await c.evict(e, reason="operator", held=True)
        elif ev == "restarting":
            await c.restart(e)
        elif ev == "superseded":
            assert c.switch(await standby(self.g, e)) is e
        elif ev == "refitted":
            c.rejoin(e)
        elif ev == "retired":
            await c.retire(e)
            await self.finish_eviction(e)
            assert e.name not in c.engines
        elif ev == "stopped":
            await c.stop_all()
            await self.finish_eviction(e)
        else:
            raise AssertionError(
                f"no driver for {label(row)}: add one to tests/supervisor/test_states.py"
            )

    async def finish_eviction(self, e: Engine) -> None:
        if self.evicting is not None:
            proc(e).release.set()
            await self.evicting
            self.evicting = None


def test_every_engine_state_is_reached_and_left() -> None:
    reached = {r.dst for r in ENGINE.rows} | {E.DEAD}
    left = {r.src for r in ENGINE.rows}
    assert reached == set(E) and left == set(E) - {E.STOPPED}
    assert E.STOPPED == "stopped" and str(E.PRIMARY) == "primary"


@pytest.mark.parametrize("row", ENGINE.rows, ids=label)
def test_engine_transition(row: Row[EngineState, str], tmp_path: Path) -> None:
    async def go() -> None:
        async with rig(tmp_path) as g:
            batch = batch_row(row) or (row.event == "ready" and row.dst == E.BATCH)
            e = g.c.engines["b-1" if batch else "e1"]
            drive = Driver(g)
            for step in path_to(row.src, batch):
                await drive(e, step)
                assert e.state == step.dst, f"on the way to {row.src}: {label(step)}"
            mark = g.events.mark()
            await drive(e, row)
            assert e.state == row.dst
            published = [(x.event, x.data["state"]) for x in g.events.since(mark, e.name)]
            assert (row.event, row.dst) in published, published
            assert hasattr(Crew, row.action), f"{row.action} is no Crew method"

    run(go())


async def ready(g: Rig, name: str) -> Engine:
    """Engine `name` spawned and ready (a standby)."""
    e = g.c.engines[name]
    await g.c.spawn(e)
    assert e.inc is not None
    g.c.ready(e, e.inc)
    return e


def test_promotion_tells_the_engine_routes_to_it_and_bumps_the_epoch(tmp_path: Path) -> None:
    async def go() -> None:
        async with rig(tmp_path) as g:
            e = await ready(g, "e1")
            g.c.promote(e, time.monotonic(), cause="no-primary", old=None)
            assert (g.c.epoch, g.c.primary, e.role) == (1, e, "primary")
            assert g.hub.sent == [("e1", Promote(epoch=1))]
            assert g.c.view.target is not None and g.c.view.target.name == "e1"
            (ev,) = [x for x in g.events.since(0, "e1") if x.event == "promoted"]
            assert ev.epoch == 1 and ev.data["told"] is True and ev.data["cause"] == "no-primary"

    run(go())


def test_a_new_epoch_from_the_fleet_tells_and_routes_the_primary(tmp_path: Path) -> None:
    """A term won raises the epoch to its floor; a term resumed below it moves it one on;
    the primary is told each new epoch and routed at it, published `epoch-raised`."""

    async def go() -> None:
        async with rig(tmp_path) as g:
            e = await ready(g, "e1")
            g.c.promote(e, time.monotonic(), cause="no-primary", old=None)
            mark = g.events.mark()
            g.c.raise_epoch(3 << 20, cluster_epoch=3)  # a term won
            g.c.raise_epoch(3 << 20, cluster_epoch=3)  # the same term, resumed
            assert g.c.epoch == (3 << 20) + 1 and e.state == E.PRIMARY
            assert g.hub.sent[1:] == [
                ("e1", Promote(epoch=3 << 20)),
                ("e1", Promote(epoch=g.c.epoch)),
            ]
            assert g.c.view.target == Target("e1", e.port, g.c.epoch)
            raised = [x for x in g.events.since(mark, "e1")]
            assert [(x.event, x.epoch, x.data["state"]) for x in raised] == [
                ("epoch-raised", 3 << 20, "primary"),
                ("epoch-raised", (3 << 20) + 1, "primary"),
            ]
            assert raised[0].data["cluster_epoch"] == 3 and raised[0].data["told"] is True

    run(go())


def test_a_new_epoch_without_a_primary_is_kept_for_the_next_promotion(tmp_path: Path) -> None:
    async def go() -> None:
        async with rig(tmp_path) as g:
            e = await ready(g, "e1")
            mark = g.events.mark()
            g.c.raise_epoch(2 << 20, cluster_epoch=2)
            assert (g.c.epoch, g.hub.sent, g.c.view.target) == (2 << 20, [], None)
            assert g.events.since(mark) == []
            g.c.promote(e, time.monotonic(), cause="no-primary", old=None)
            assert g.hub.sent == [("e1", Promote(epoch=(2 << 20) + 1))]

    run(go())


def test_losing_the_primary_promotes_the_best_standby_before_it_is_published_dead(
    tmp_path: Path,
) -> None:
    async def go() -> None:
        async with rig(tmp_path) as g:
            e1, e2 = g.c.engines["e1"], g.c.engines["e2"]
            for e in (e1, e2):
                await g.c.spawn(e)
                assert e.inc is not None
                g.c.on_http_beat(e, e.inc)  # heard from: ready, with a fresh heartbeat
            g.c.promote(e1, time.monotonic(), cause="no-primary", old=None)
            mark = g.events.mark()
            assert e1.inc is not None
            g.c.on_exit(e1, e1.inc, "rank 0 exited with -9")
            order = [(x.name, x.event) for x in g.events.since(mark)]
            assert order == [("e2", "promoted"), ("e1", "died")]
            assert g.c.primary is e2 and e1.role == "standby" and e1.state == E.DEAD

    run(go())


def test_an_evicted_engine_that_is_stopped_while_draining_stays_stopped(tmp_path: Path) -> None:
    async def go() -> None:
        async with rig(tmp_path) as g:
            e = g.c.engines["b-1"]
            await g.c.spawn(e)
            proc(e).hold = True
            evicting = asyncio.ensure_future(g.c.evict(e, reason="load 9 > 8", held=False))
            await proc(e).terminating.wait()
            assert g.hub.sent[-1] == ("b-1", Drain(grace_s=0.5))
            await g.c.stop_all()
            proc(e).release.set()
            await evicting
            assert e.state == E.STOPPED

    run(go())


@pytest.mark.parametrize("start", [False, True], ids=["dead", "starting"])
def test_promoting_what_is_not_a_standby_raises_and_changes_nothing(
    start: bool, tmp_path: Path
) -> None:
    async def go() -> None:
        async with rig(tmp_path) as g:
            e = g.c.engines["e1"]
            if start:
                await g.c.spawn(e)
            state = e.state
            with pytest.raises(IllegalTransition, match=f"'promoted' from {state}: no row"):
                g.c.promote(e, time.monotonic(), cause="no-primary", old=None)
            assert (g.c.epoch, g.c.primary, e.state, g.hub.sent) == (0, None, state, [])

    run(go())


def test_ready_is_ignored_unless_starting(tmp_path: Path) -> None:
    async def go() -> None:
        async with rig(tmp_path) as g:
            e = g.c.engines["e1"]
            mark = g.events.mark()
            g.c.ready(e, Incarnation([]))
            assert e.state == E.DEAD and g.events.since(mark) == []

    run(go())


def test_only_move_assigns_a_state() -> None:
    """`states.move` is the one place a unit's state is set, in the whole package."""
    package = Path(supervisor.__file__).parent
    offenders = [
        f"{path.name}:{n}: {line.strip()}"
        for path in sorted(package.glob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if " = " in line
        and ".state" in (lhs := line.split(" = ")[0])
        and "(" not in lhs
        and (path.name, line.strip()) != ("states.py", "unit.state = row.dst")
    ]
    assert offenders == [], "set states through the table (states.move): " + "; ".join(offenders)


def test_table_lookup_names_what_is_wrong() -> None:
    with pytest.raises(IllegalTransition, match=r"'died' from dead: no row"):
        ENGINE.lookup(E.DEAD, "died")
    with pytest.raises(IllegalTransition, match="2 rows"):
        ENGINE.lookup(E.STARTING, "ready")
    assert ENGINE.lookup(E.STARTING, "ready", E.BATCH).dst == E.BATCH
    with pytest.raises(IllegalTransition, match="twice"):
        Table("engine", [(E.DEAD, "starting", E.STARTING, "spawn")] * 2)
    unit = Daemon(rank=0, device="cpu", book=RestartBook(RestartSpec()))
    assert move(unit, DAEMON, "starting").dst == D.STARTING and unit.state == D.STARTING


def test_the_cache_daemons_wake_the_crew_they_share_a_term_with(tmp_path: Path) -> None:
    async def go() -> None:
        async with rig(tmp_path) as g:
            daemons = CacheDaemons(policy(), tmp_path, "model", g.bus, g.c.term)
            d = daemons.daemons[0]
            try:
                g.c.raise_epoch(4, cluster_epoch=1)  # no primary: the epoch only
                mark = g.events.mark()
                daemons.follow(d, Incarnation([FakeProc()]))
                g.c.wake.clear()
                daemons.served(d, DaemonReady(1, None, "s", ""), 1, time.monotonic())
                assert g.c.wake.is_set()
                assert [(x.event, x.epoch) for x in g.events.since(mark, "0")] == [
                    ("starting", 4),
                    ("serving", 4),
                ]
            finally:
                await daemons.stop()

    run(go())


# ---- daemons ----


async def drive_daemon(daemons: CacheDaemons, d: Daemon, row: Row[DaemonState, str]) -> None:
    now = time.monotonic()
    if row.event == "starting":
        daemons.follow(d, Incarnation([FakeProc()]))
    elif row.event == "serving":
        daemons.served(d, DaemonReady(1, None, "s", "f00d", adopted=True), 4096, now)
    elif row.event in ("dead", "quarantined"):
        assert d.inc is not None
        d.book.reset()
        for _ in range(daemons.policy.restart.max_restarts if row.event == "quarantined" else 0):
            d.book.record(now)
        daemons.exited(d, d.inc, -9, now)
    elif row.event == "stopped":
        await daemons.stop()
    else:
        raise AssertionError(
            f"no driver for daemon {label(row)}: add one to tests/supervisor/test_states.py"
        )


def daemon_path(state: DaemonState) -> list[Row[DaemonState, str]]:
    paths: dict[DaemonState, list[Row[DaemonState, str]]] = {D.DEAD: []}
    todo = collections.deque([D.DEAD])
    while todo:
        s = todo.popleft()
        for r in DAEMON.rows:
            if r.src == s and r.dst not in paths and r.event != "stopped":
                paths[r.dst] = [*paths[s], r]
                todo.append(r.dst)
    return paths[state]


@pytest.mark.parametrize("row", DAEMON.rows, ids=label)
def test_daemon_transition(row: Row[DaemonState, str], tmp_path: Path) -> None:
    async def go() -> None:
        async with bus_at(tmp_path) as bus:
            events = bus.subscribe()
            daemons = CacheDaemons(policy(), tmp_path, "model", bus, Term(epoch=3))
            d = daemons.daemons[0]
            try:
                for step in daemon_path(row.src):
                    await drive_daemon(daemons, d, step)
                    assert d.state == step.dst, f"on the way to {row.src}: {label(step)}"
                while not events.empty():
                    events.get_nowait()
                await drive_daemon(daemons, d, row)
                assert d.state == row.dst
                published = []
                while not events.empty():
                    published.append(events.get_nowait())
                assert (row.event, "daemon.0." + row.event) in [
                    (x.event, x.topic) for x in published
                ]
                assert all(x.epoch == 3 for x in published)
                assert hasattr(CacheDaemons, row.action), f"{row.action} is no CacheDaemons method"
            finally:
                await daemons.stop()

    run(go())


def test_a_dead_daemon_with_a_live_spare_follows_the_spare_at_once(tmp_path: Path) -> None:
    async def go() -> None:
        async with bus_at(tmp_path) as bus:
            events = bus.subscribe()
            daemons = CacheDaemons(policy(), tmp_path, "model", bus, Term(epoch=1))
            d = daemons.daemons[0]
            try:
                daemons.follow(d, Incarnation([FakeProc()]))
                daemons.served(d, DaemonReady(1, None, "s", ""), 1, time.monotonic())
                spare = Incarnation([FakeProc()])
                d.spare = spare
                assert d.inc is not None
                daemons.exited(d, d.inc, -9, time.monotonic())
                assert d.state == D.STARTING and d.inc is spare and d.spare is None
                seen = []
                while not events.empty():
                    seen.append(events.get_nowait())
                assert [(x.event, x.data.get("spare")) for x in seen][-2:] == [
                    ("dead", None),
                    ("starting", True),
                ]
            finally:
                await daemons.stop()

    run(go())


def test_reconcile_starts_a_dead_daemon_once_when_its_backoff_ran_out(tmp_path: Path) -> None:
    async def go() -> None:
        async with bus_at(tmp_path) as bus:
            daemons = CacheDaemons(policy(), tmp_path, "model", bus, Term(epoch=1))
            d = daemons.daemons[0]
            d.next_start = 10.0
            assert daemons.reconcile(now=9.0) == 10.0 and not d.spawning
            assert daemons.reconcile(now=10.0) is None and d.spawning
            assert daemons.reconcile(now=11.0) is None  # the start under way is not repeated
            await daemons.stop()

    run(go())
