"""The supervisor: a reconcile loop over daemons, one primary, standbys and batch engines.

Each tick compares what the policy wants with what runs and converges. Child exits and
agent messages wake the loop at once; hangs are found by missed heartbeats. Losing the
primary is handled in the same call that sees it: fence, epoch += 1, route to the best
standby, tell it to promote, publish; the replacement standby comes from the next tick.

`Cluster` owns every engine's state: each change is one row of `states.ENGINE`, made by
the method that row names, and published as that row's event. What to do (whom to
promote, fence or evict) is decided in `decisions`; `Cluster` carries it out.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping
from typing import Any

import structlog

from holdfast_contract.agent_protocol import Ack, Drain, Heartbeat, Hello, Promote, StateChange
from holdfast_contract.control import ClusterStatus, DaemonStatus
from supervisor import decisions
from supervisor.errors import ControlError, StartupError
from supervisor.events import EngineUnitState, EventBus
from supervisor.exitwatch import Death, ExitWatch, Sight, first_death, is_exiting
from supervisor.kinds import kind_of
from supervisor.pace import LoopPace, thread_runs
from supervisor.policy import Policy
from supervisor.priority import renice
from supervisor.realtime import RealtimeSection
from supervisor.router import PrimaryView, Target
from supervisor.states import ENGINE, EngineState, move
from supervisor.units import READY_STATES, Engine, Incarnation, Want, engines_of
from supervisor.wiring import Commands, Daemons, Launcher

log = structlog.get_logger("supervisor")
S = EngineState


class CpuMark:
    """This thread's CPU time at one moment (one system call: a mark taken inside a
    promotion is paid for by the promotion)."""

    __slots__ = ("cpu",)

    def __init__(self, cpu: float) -> None:
        self.cpu = cpu

    @classmethod
    def now(cls) -> CpuMark:
        return cls(time.thread_time())

    def since(self) -> float:
        """CPU ms since this mark."""
        return round((time.thread_time() - self.cpu) * 1000, 3)


class Cluster:
    """The engines, and every transition between their states."""

    def __init__(
        self,
        policy: Policy,
        bus: EventBus,
        view: PrimaryView,
        *,
        hub: Commands,
        launcher: Launcher,
        daemons: Daemons,
    ) -> None:
        self.policy = policy
        self.bus = bus
        self.view = view
        self.hub = hub
        self.launcher = launcher
        self.daemons = daemons
        self.epoch = 0
        self.primary: Engine | None = None
        self.wake = asyncio.Event()
        self.refused: dict[str, str] = {}  # primaries that failed their promotion
        self.early_hellos: dict[str, Hello] = {}  # arrived while their engine was spawning
        self.windows = decisions.Windows.of(policy)
        interval_s = policy.heartbeat.interval_ms / 1000.0
        # the supervisor's own stalls (run by the service), not counted as engines' silence
        self.pace = LoopPace(
            period_s=interval_s / 4,
            tolerance_s=interval_s / 4,
            keep_s=max(self.windows.busy_silence_s, self.windows.starting_silence_s) + 1.0,
        )
        self.batch = decisions.BatchGovernor(
            policy.engines.load, policy.heartbeat.interval_ms / 1000.0, policy.devices.memory_mb
        )
        poll_ms = policy.heartbeat.exit_poll_ms
        self.realtime = RealtimeSection(policy.heartbeat.realtime_promotion)
        self.exit_watch = (
            ExitWatch(poll_ms / 1000.0, self._exiting, self.realtime) if poll_ms else None
        )
        self.engines: dict[str, Engine] = {e.name: e for e in engines_of(policy)}
        self.warms = policy.router.warm_every > 0 and kind_of(policy).warms

    # ---- the one way an engine's state changes ----
    def _move(self, e: Engine, event: str, to: EngineState | None = None, **data: Any) -> None:
        """Make the move the table has for (e.state, event[, to]) and publish `event`;
        raises IllegalTransition when there is no such row."""
        move(e, ENGINE, event, to)
        self.publish(e, event, **data)
        self._name_heir()

    def _name_heir(self) -> None:
        """Tell the router which standby is promoted next: it keeps streams' pasts warm
        there (router.warm_every), if this kind of engine keeps them."""
        h = self.best_standby() if self.warms else None
        now = self.view.heir
        if h is None:
            self.view.heir = None
        elif now is None or now.name != h.name or now.port != h.port:
            self.view.heir = Target(h.name, h.port, 0)

    def publish(self, e: Engine, event: str, **data: Any) -> None:
        data.setdefault("pid", e.pid)
        self.bus.emit(
            "engine", e.name, event, self.epoch, role=e.role, state=e.state, port=e.port, **data
        )
        self._retain(e)

    def _retain(self, e: Engine) -> None:
        """Publish `e`'s retained state: its state and what the rules want of it."""
        now, wall = time.monotonic(), time.time()
        self.bus.state(
            EngineUnitState(
                ts=wall,
                kind="engine",
                name=e.name,
                state=e.state,
                epoch=self.epoch,
                role=e.role,
                pid=e.pid,
                wanted=e.wanted.wire(now, wall) if e.wanted is not None else None,
            )
        )

    def want(self, wants: Mapping[str, Want]) -> None:
        """What the rules want of each engine now, by name (`BatchGovernor.wants`): kept
        for its status, and its retained state published again where it changed (no
        event: its state did not move)."""
        for name, w in wants.items():
            e = self.engines[name]
            if e.wanted != w:
                e.wanted = w
                self._retain(e)

    # ---- agent messages ----
    def _engine_for(self, name: str) -> tuple[Engine, Incarnation] | None:
        e = self.engines.get(name)
        if e is None or e.inc is None or e.inc.handled:
            return None
        return e, e.inc

    def on_hello(self, msg: Hello) -> None:
        """Accept a Hello only from a process of this incarnation's own process group, so
        nothing a fenced predecessor sent can speak for its replacement."""
        found = self._engine_for(msg.name)
        if found is None:
            if msg.name in self.engines:  # a forked rank 0 can speak before its siblings
                self.early_hellos[msg.name] = msg  # exist: judged once spawn() returns
            return
        e, inc = found
        try:
            ours = os.getpgid(msg.pid) in {p.pid for p in inc.procs}
        except ProcessLookupError:
            ours = False
        if not ours:
            self.bus.emit("engine", e.name, "stray-hello", self.epoch, pid=msg.pid)
            return
        inc.hello = True
        if thread_runs(msg.pid, msg.tid) is not None:
            inc.beat_thread = (msg.pid, msg.tid)
        self._beat(e, inc)

    @staticmethod
    def _beat(e: Engine, inc: Incarnation) -> None:
        """A sign of life from `e`'s agent: now, and how often its heartbeat thread ran."""
        e.last_beat = time.monotonic()
        inc.beat_runs = thread_runs(*inc.beat_thread)

    def on_heartbeat(self, msg: Heartbeat) -> None:
        found = self._engine_for(msg.name)
        if found is None or not found[1].hello:
            return
        e, inc = found
        self._beat(e, inc)
        e.in_flight, e.queued = msg.in_flight, msg.queued
        if msg.state in READY_STATES:
            self.ready(e, inc)

    def on_state(self, msg: StateChange) -> None:
        found = self._engine_for(msg.name)
        if found is None or not found[1].hello:
            return
        self._beat(*found)
        if msg.state in READY_STATES:
            self.ready(*found)
        else:
            self.bus.emit(
                "engine", msg.name, f"reported-{msg.state}", self.epoch, detail=msg.detail
            )

    def on_ack(self, msg: Ack) -> None:
        if msg.command == "promote":
            self.view.ack(msg.name)
            if not msg.ok and self.primary is not None and self.primary.name == msg.name:
                self.refused[msg.name] = msg.detail  # fenced by the next tick
                self.wake.set()
        if not msg.ok:
            self.bus.emit(
                "engine",
                msg.name,
                "command-failed",
                self.epoch,
                command=msg.command,
                detail=msg.detail,
            )

    def on_load(self, e: Engine, inc: Incarnation, in_flight: int, queued: int) -> None:
        """`e`'s load as its kind's probe read it (vLLM's /metrics)."""
        if e.inc is inc and not inc.handled:
            e.in_flight, e.queued = in_flight, queued

    def on_http_beat(self, e: Engine, inc: Incarnation) -> None:
        if e.inc is inc and not inc.handled:
            inc.hello = True
            e.last_beat = time.monotonic()
            self.ready(e, inc)

    def ready(self, e: Engine, inc: Incarnation) -> None:
        """starting -> standby | batch, the first time its agent (or /health) says ready."""
        if inc.ready or e.state != S.STARTING:
            return
        inc.ready = True
        to = S.STANDBY if e.serving else S.BATCH
        self._move(e, "ready", to, start_ms=round((time.monotonic() - inc.started) * 1000, 1))
        self.wake.set()

    # ---- failures ----
    def _exiting(self, name: str, sights: list[Sight]) -> None:
        """Processes of the primary have begun to exit (they run no more user code): kill
        the rest of its group without waiting for the exits, and promote now. The rank
        named is the one whose death brought the group down (`first_death`).

        Rank 0 serves HTTP: once it is exiting nothing of the group can answer a client,
        so the standby is routed to first and the group killed after. Another rank
        leaves rank 0 able to answer, so that group is killed before the promotion."""
        e = self.engines.get(name)
        inc = e.inc if e is not None else None
        if e is None or inc is None or inc.handled or e is not self.primary:
            return
        t_detect = time.monotonic()
        codes = {s.pid: s.code for s in sights}
        first = first_death(
            [
                Death(rank, p.returncode if codes[p.pid] is None else codes[p.pid], p.signalled)
                for rank, p in enumerate(inc.procs)
                if p.pid in codes
            ]
            or [Death(0, None, False)]
        )
        # (the exit watch looked inside the real-time section: `promote` leaves it once
        # routed and told, the watch after this returns)
        if first.rank != 0:
            for p in inc.procs:
                p.kill_group()
        self.down(e, inc, cause="exit", detail=first.detail(), t_detect=t_detect)
        if first.rank == 0:
            for p in inc.procs:
                p.kill_group()

    def on_exit(self, e: Engine, inc: Incarnation, detail: str) -> None:
        """A rank of `e` exited: the group is already killed; handle it now."""
        self.down(e, inc, cause="exit", detail=detail, t_detect=time.monotonic())

    def down(
        self,
        e: Engine,
        inc: Incarnation,
        *,
        cause: str,
        detail: str,
        t_detect: float,
        counted: bool = True,
    ) -> None:
        """`e` is fenced (its group killed): promote if it was primary, then -> dead (its
        restart due after its backoff) or quarantined (restarted too often)."""
        cpu = CpuMark.now()
        inc.handled = True
        e.in_flight = e.queued = 0
        if self.primary is e:
            self.primary = None
            silent_ms = round((t_detect - e.last_beat) * 1000, 1) if e.last_beat else None
            self._promote_best(t_detect, cause=cause, old=e.name, silent_ms=silent_ms, cpu=cpu)
            if self.primary is None:  # none promoted: nothing to route to
                self.view.set(None)  # (a promotion routes to its own at once)
                if self.exit_watch is not None:
                    self.exit_watch.clear()  # (and a promotion watches its own)
        tail = inc.tail()
        if counted and e.book.record():
            self._move(
                e,
                "quarantined",
                cause=cause,
                detail=detail,
                tail=tail,
                restarts=e.book.recent(),
                pid=inc.pid,
            )
        else:
            e.next_start = time.monotonic() + (e.book.delay() if counted else 0.0)
            self._move(e, "died", cause=cause, detail=detail, tail=tail, pid=inc.pid)
        e.role = "batch" if not e.serving else "standby"  # published as it died
        self.wake.set()

    async def fence(self, e: Engine, *, cause: str, detail: str, counted: bool = True) -> None:
        """SIGKILL `e`'s process groups; once each is seen killed (SIGKILL pending,
        exiting or gone: it runs no more user code, see `exitwatch`), or else its exit is
        confirmed, handle it as down (a primary's standby is promoted). The exits of
        killed processes are not waited for here (their reapers see them, as after an
        exit the exit watch saw begin)."""
        inc = e.inc
        if inc is None or inc.handled:
            return
        primary = e is self.primary
        if primary:
            self.realtime.enter()  # up to routed and told, as for an exit (`promote` leaves)
        t_detect = time.monotonic()
        inc.handled = True
        for p in inc.procs:
            p.kill_group()
        killed = all(is_exiting(p.pid) for p in inc.procs)
        confirmed = killed
        if not killed:  # (a pid reused already, say): wait for the exit itself
            self.realtime.leave()
            confirmed = await self._kill(e, inc)
            if primary:
                self.realtime.enter()
        # before any promotion `down` makes: the event order shows the fence came first
        self.publish(e, "fenced", cause=cause, detail=detail, pid=inc.pid, confirmed=confirmed)
        self.down(e, inc, cause=cause, detail=detail, t_detect=t_detect, counted=counted)
        self.realtime.leave()  # (no standby was promoted)

    async def _kill(self, e: Engine, inc: Incarnation) -> bool:
        confirmed = all([await p.fence() for p in inc.procs])
        if not confirmed:
            log.error("fence_unconfirmed", engine=e.name, pids=[p.pid for p in inc.procs])
        return confirmed

    # ---- promotion ----
    def best_standby(self) -> Engine | None:
        """The standby to promote: the one the router keeps pasts warm on, if ready."""
        heir = self.view.heir.name if self.view.heir is not None else None
        return decisions.best_standby(
            self.engines.values(), time.monotonic(), self.windows.hang_s, prefer=heir
        )

    def _promote_best(
        self,
        t_detect: float,
        *,
        cause: str,
        old: str | None,
        silent_ms: float | None,
        cpu: CpuMark | None = None,
    ) -> None:
        s = self.best_standby()
        if s is not None:
            self.promote(s, t_detect, cause=cause, old=old, silent_ms=silent_ms, cpu=cpu)

    def promote(
        self,
        s: Engine,
        t_detect: float,
        *,
        cause: str,
        old: str | None,
        silent_ms: float | None = None,
        cpu: CpuMark | None = None,
    ) -> None:
        """standby -> primary: route to `s` and tell it; `silent_ms`: how long the old
        primary had been silent when its loss was detected, `promote_ms`: detection to
        routed and told; with `cpu` (taken as `down` began: after a fence's kill, which
        `promote_ms` includes), how much of that the supervisor spent on a CPU
        (`promote_cpu_ms`; the rest it waited, descheduled or blocked): what tells a slow
        promotion from a descheduled one; `promote_realtime`: whether it ran as
        SCHED_FIFO (`supervisor.realtime`)."""
        ENGINE.lookup(s.state, "promoted")  # raises before anything is done for `s`
        self.epoch += 1
        s.role = "primary"
        self.primary = s
        told = self._route_to(s)
        cpu_ms = cpu.since() if cpu is not None else None  # (inside the wall-clock window)
        promote_ms = round((time.monotonic() - t_detect) * 1000, 3)
        realtime = self.realtime.held
        self.realtime.leave()  # (entered where the loss was seen, if it was)
        if s.inc is not None and self.policy.engines.primary_nice:  # before it is said
            renice([p.pid for p in s.inc.procs], self.policy.engines.primary_nice)
        self._move(
            s,
            "promoted",
            previous=old,
            cause=cause,
            told=told,
            silent_ms=silent_ms,
            promote_ms=promote_ms,
            promote_cpu_ms=cpu_ms,
            promote_realtime=realtime,
        )
        if self.exit_watch is not None and s.inc is not None:  # once routed and told
            self.exit_watch.watch(s.name, [p.pid for p in s.inc.procs])

    def _route_to(self, p: Engine) -> bool:
        """Tell `p` to serve at the current epoch and route to it (the router waits for
        its ack if it was told); whether it was told."""
        told = self.hub.send(p.name, Promote(epoch=self.epoch))
        self.view.set(Target(p.name, p.port, self.epoch), await_ack=told)
        return told

    def raise_epoch(self, floor: int, *, cluster_epoch: int) -> None:
        """A new epoch from the fleet (this node's term `cluster_epoch` won or resumed):
        the epoch jumps to at least `floor`, and one past the last, so it grows across
        leaderships. A promoted primary is told and routed at it (primary -> primary,
        `epoch-raised`), so a request cut when a term lapsed is retried at the raised
        epoch; without one, the next promotion uses it."""
        self.epoch = max(self.epoch + 1, floor)
        p = self.primary
        if p is None or p.state != S.PRIMARY:
            return
        told = self._route_to(p)
        self._move(p, "epoch-raised", cluster_epoch=cluster_epoch, told=told)

    async def hand_over(self, new: Engine) -> None:
        """`supervisor promote NEW`: fence the primary (it restarts at once, as a standby,
        uncounted) and promote `new`, a ready standby."""
        if new.state != S.STANDBY:
            raise ControlError(
                f"{new.name} is {new.state}; only a ready standby can be promoted "
                "(see `supervisor status`)"
            )
        old = self.primary
        t0 = time.monotonic()
        if old is not None and old.inc is not None:
            inc = old.inc
            inc.handled = True
            await self._kill(old, inc)
            self.primary = None
            old.next_start = time.monotonic()
            self._move(old, "fenced", cause="operator-promote", pid=inc.pid)
            old.role = "standby"  # it restarts as one; `fenced` says what it was
        self.promote(new, t0, cause="operator", old=old.name if old else None)
        self.wake.set()

    # ---- eviction ----
    async def evict(self, e: Engine, *, reason: str, held: bool) -> None:
        """A batch engine leaves: running -> draining -> evicted (SIGTERM, its grace, then
        SIGKILL); one not running -> evicted at once. `held`: until `supervisor restart`."""
        e.held = held or e.held
        inc = e.inc
        if e.state in (S.DEAD, S.QUARANTINED):
            self._move(e, "evicted", reason=reason)
            return
        if inc is None or inc.handled or not e.running:
            return  # evicted already, or on its way out (draining, being fenced)
        inc.handled = True
        self._move(e, "draining", reason=reason)
        grace = self.policy.engines.stop_grace_s
        self.hub.send(e.name, Drain(grace_s=grace))
        await asyncio.gather(*(p.terminate(grace) for p in inc.procs))
        e.in_flight = 0
        if e.state == S.DRAINING:  # not stopped meanwhile (the supervisor stops)
            self._move(e, "evicted", reason=reason)

    async def restart(self, e: Engine) -> None:
        """`supervisor restart NAME`: fence it if it runs (uncounted), forget its restart
        count and start it again now, even if it was evicted by hand or quarantined."""
        if e.state == S.DRAINING:
            raise ControlError(f"{e.name} is draining; restart it once it is evicted")
        if e.running:
            await self.fence(e, cause="operator-restart", detail="restarted by hand", counted=False)
        if e.running:  # another fence of it is under way
            raise ControlError(f"{e.name} is being stopped already; restart it once it is dead")
        e.held = False
        e.next_start = time.monotonic()
        e.book.reset()
        self._move(e, "restarting")
        self.wake.set()

    # ---- status ----
    def snapshot(self) -> ClusterStatus:
        now, wall = time.monotonic(), time.time()
        engines = [e.status(now, wall) for e in self.engines.values()]
        daemons = [
            DaemonStatus(
                rank=d.rank,
                state=d.state,
                pid=d.pid,
                fingerprint=d.fingerprint,
                pool_bytes=d.pool_bytes,
                adoptions=d.adoptions,
                adopted=d.adopted,
                checkpoint_changed=list(d.checkpoint_changed),
            )
            for d in self.daemons.daemons
        ]
        mqtt = self.bus.mqtt
        return ClusterStatus(
            epoch=self.epoch,
            primary=self.primary.name if self.primary else None,
            engines=engines,
            daemons=daemons,
            events=self.bus.count,
            events_dropped=self.bus.dropped,
            mqtt_connected=bool(mqtt and mqtt.connected),
        )

    def find(self, name: str) -> Engine:
        e = self.engines.get(name)
        if e is None:
            known = ", ".join(self.engines)
            raise ControlError(f"no engine named {name!r}; engines: {known}")
        return e

    async def spawn(self, e: Engine) -> None:
        """dead | evicted -> starting; quarantined when its command cannot start."""
        self.daemons.before_handout(e.name)
        try:
            inc = await self.launcher.spawn(e, self.epoch)
        except StartupError as err:
            e.book.record()
            self._move(e, "quarantined", cause="spawn", detail=str(err))
            return
        e.inc, e.last_beat, e.held = inc, 0.0, False
        e.in_flight = e.queued = 0
        self._move(e, "starting", restarts=e.book.total)
        early = self.early_hellos.pop(e.name, None)
        if early is not None:
            self.on_hello(early)

    async def stop_all(self) -> None:
        """Every running engine -> stopped (SIGTERM, stop_grace_s, SIGKILL)."""
        self.want(dict.fromkeys(self.engines, decisions.STOPPING))
        if self.exit_watch is not None:
            await self.exit_watch.close()
        for e in self.engines.values():
            if e.inc is not None:
                e.inc.handled = True
        grace = self.policy.engines.stop_grace_s
        await asyncio.gather(
            *(
                p.terminate(grace)
                for e in self.engines.values()
                if e.inc is not None
                for p in e.inc.procs
            )
        )
        for e in self.engines.values():
            if e.running:
                self._move(e, "stopped")
        self.view.set(None)
