"""The supervisor's crew: a reconcile loop over daemons, one primary, standbys and
batch engines.

Each tick (`reconcile.tick`) compares what the policy wants with what runs and converges.
Child exits and agent messages wake the loop at once; hangs are found by missed
heartbeats. `Crew` takes in what the agents, the launcher and the cache daemons report,
evicts, restarts and spawns engines, and answers status; the failover core it builds on
(`failover.Failover`: down, fence, promote) handles a loss, and `roster.Roster` holds the
engines and the one way their state changes (a row of `states.ENGINE`, published as its
event). What to do (whom to promote, fence or evict) is decided in `decisions`; `Crew`
carries it out.
"""

from __future__ import annotations

import asyncio
import os
import time

from holdfast_contract.agent_protocol import Ack, Drain, Heartbeat, Hello, Refitted, StateChange
from holdfast_contract.control import CrewStatus, DaemonStatus, UpdateStatus
from holdfast_contract.events import EventName as N
from supervisor import decisions
from supervisor.errors import ControlError, StartupError
from supervisor.events import EventBus
from supervisor.failover import Failover
from supervisor.pace import LoopPace, thread_runs
from supervisor.policy import Policy, admission_cap_mb
from supervisor.primary import PrimaryView
from supervisor.states import EngineState
from supervisor.units import READY_STATES, Engine, Incarnation
from supervisor.wiring import Commands, Daemons, Launcher, Term

S = EngineState


class Crew(Failover):
    """The engines: what their agents report, and every transition between their states."""

    def __init__(
        self,
        policy: Policy,
        bus: EventBus,
        view: PrimaryView,
        term: Term,
        *,
        hub: Commands,
        launcher: Launcher,
        daemons: Daemons,
    ) -> None:
        super().__init__(policy, bus, view, term, hub)
        self.launcher = launcher
        self.daemons = daemons
        self.refused: dict[str, str] = {}  # primaries that failed their promotion
        self.early_hellos: dict[str, Hello] = {}  # arrived while their engine was spawning
        self.update: UpdateStatus | None = None  # a rolling update's, set by its Rollout
        # the engines told to refit, each awaiting its Refitted (supervisor/update/refit.py)
        self.refits: dict[str, asyncio.Future[Refitted]] = {}
        interval_s = policy.heartbeat.interval_ms / 1000.0
        # the supervisor's own stalls (run by the service), not counted as engines' silence
        self.pace = LoopPace(
            period_s=interval_s / 4,
            tolerance_s=interval_s / 4,
            keep_s=max(self.windows.busy_silence_s, self.windows.starting_silence_s) + 1.0,
        )
        self.batch = decisions.BatchGovernor(
            policy.engines.load, policy.heartbeat.interval_ms / 1000.0, admission_cap_mb(policy)
        )

    # ---- agent messages ----
    def kv_held(self, key: str) -> str:
        return self.daemons.kv_ident(key)

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
            self.bus.emit("engine", e.name, N.STRAY_HELLO, self.epoch, pid=msg.pid)
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
        if self.view.heir is None and e.state == S.STANDBY:
            self._name_heir()  # a standby heard again after a late beat may be the heir
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
            if msg.kv_streams is not None:
                self.bus.emit("engine", msg.name, N.KV_ADOPTED, self.epoch, streams=msg.kv_streams)
            elif msg.kv_why:  # its cut streams' continuations compute their pasts again
                self.bus.emit("engine", msg.name, N.KV_NOT_ADOPTED, self.epoch, why=msg.kv_why)
            if not msg.ok and self.primary is not None and self.primary.name == msg.name:
                self.refused[msg.name] = msg.detail  # fenced by the next tick
                self.wake.set()
        if not msg.ok:
            self.bus.emit(
                "engine",
                msg.name,
                N.COMMAND_FAILED,
                self.epoch,
                command=msg.command,
                detail=msg.detail,
            )

    def on_refitted(self, msg: Refitted) -> None:
        waiter = self.refits.pop(msg.name, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(msg)

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
        self._move(e, N.READY, to, start_ms=round((time.monotonic() - inc.started) * 1000, 1))
        self.wake.set()

    # ---- eviction ----
    async def evict(self, e: Engine, *, reason: str, held: bool) -> None:
        """A batch engine leaves: running -> draining -> evicted (SIGTERM, its grace, then
        SIGKILL); one not running -> evicted at once. `held`: until `supervisor restart`."""
        e.held = held or e.held
        inc = e.inc
        if e.state in (S.DEAD, S.QUARANTINED):
            self._move(e, N.EVICTED, reason=reason)
            return
        if inc is None or inc.handled or not e.running:
            return  # evicted already, or on its way out (draining, being fenced)
        inc.handled = True
        self._move(e, N.DRAINING, reason=reason)
        grace = self.policy.engines.stop_grace_s
        self.hub.send(e.name, Drain(grace_s=grace))
        await asyncio.gather(*(p.terminate(grace) for p in inc.procs))
        e.in_flight = 0
        if e.state == S.DRAINING:  # not stopped meanwhile (the supervisor stops)
            self._move(e, N.EVICTED, reason=reason)

    def rejoin(self, e: Engine, **data: object) -> None:
        """A refit's superseded primary, done with its requests and refitted in place,
        stands by again (draining -> standby, `refitted`): its exit is a loss again."""
        if e.inc is not None:
            e.inc.handled = False
        self._move(e, N.REFITTED, S.STANDBY, version=e.version, **data)
        self.wake.set()

    async def retire(self, e: Engine) -> None:
        """An engine of a version no longer served leaves the crew (a rolling update's old
        engines, or a refused version's): SIGTERM, `engines.stop_grace_s`, SIGKILL, then
        -> stopped (`retired`) and out of the roster. A superseded primary is drained
        first (supervisor/update/)."""
        if e is self.primary:
            raise ControlError(f"{e.name} is the primary; an update supersedes it first")
        inc = e.inc
        if inc is not None:
            inc.handled = True
            grace = self.policy.engines.stop_grace_s
            await asyncio.gather(*(p.terminate(grace) for p in inc.procs))
        e.in_flight = e.queued = 0
        if e.state != S.STOPPED:  # (stopped meanwhile: the supervisor stops)
            self._move(e, N.RETIRED, version=e.version)
        self.engines.pop(e.name, None)
        self.daemons.drop_kv(e.name)
        self.wake.set()

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
        self._move(e, N.RESTARTING)
        self.wake.set()

    # ---- status ----
    def snapshot(self) -> CrewStatus:
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
                version=d.version,
                generation=self.daemons.generation,
            )
            for d in self.daemons.daemons
        ]
        mqtt = self.bus.mqtt
        return CrewStatus(
            epoch=self.epoch,
            primary=self.primary.name if self.primary else None,
            engines=engines,
            daemons=daemons,
            events=self.bus.count,
            events_dropped=self.bus.dropped,
            mqtt_connected=bool(mqtt and mqtt.connected),
            version=self.version,
            update=self.update,
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
            inc = await self.launcher.spawn(e, self.epoch, self)
        except StartupError as err:
            if e.state != S.STOPPED:  # (retired meanwhile)
                e.book.record()
                self._move(e, N.QUARANTINED, cause="spawn", detail=str(err))
            return
        if e.state == S.STOPPED:  # retired while it was being started: it never was
            inc.handled = True
            await asyncio.gather(*(p.fence() for p in inc.procs))
            return
        e.inc, e.last_beat, e.held = inc, 0.0, False
        e.in_flight = e.queued = 0
        self._move(e, N.STARTING, restarts=e.book.total)
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
                self._move(e, N.STOPPED)
        self.view.set(None)
