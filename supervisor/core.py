"""The supervisor: a reconcile loop over daemons, one primary, standbys and batch engines.

Each tick compares what the policy wants with what runs and converges. Child exits and
agent messages wake the loop at once; hangs are found by missed heartbeats. Losing the
primary is handled in the same call that sees it: fence, epoch += 1, route to the best
standby, tell it to promote, publish; the replacement standby comes from the next tick.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from typing import Any

import structlog

from holdfast_contract.agent_protocol import Ack, Drain, Heartbeat, Hello, Promote, StateChange
from holdfast_contract.control import ClusterStatus, DaemonStatus, EngineStatus
from supervisor.agent_hub import AgentHub
from supervisor.backoff import RestartBook
from supervisor.daemons import DaemonPool
from supervisor.engines import EngineLauncher
from supervisor.errors import ControlError, StartupError
from supervisor.events import EventBus, UnitState
from supervisor.exitwatch import ExitWatch
from supervisor.policy import Policy
from supervisor.router import PrimaryView, Target
from supervisor.units import READY_STATES, Engine, Incarnation

log = structlog.get_logger("supervisor")


class Cluster:
    """The engines and daemons, and every transition between their states."""

    def __init__(self, policy: Policy, bus: EventBus, view: PrimaryView) -> None:
        self.policy = policy
        self.bus = bus
        self.view = view
        self.epoch = 0
        self.primary: Engine | None = None
        self.engines: dict[str, Engine] = {}
        self.hub: AgentHub | None = None
        self.launcher: EngineLauncher | None = None
        self.daemons: DaemonPool | None = None
        self.wake = asyncio.Event()
        self.refused: dict[str, str] = {}  # primaries that failed their promotion
        self.early_hellos: dict[str, Hello] = {}  # arrived while their engine was spawning
        self.low_since: float | None = None
        self.last_evict = 0.0
        poll_ms = policy.heartbeat.exit_poll_ms
        self.exit_watch = ExitWatch(poll_ms / 1000.0, self._exiting) if poll_ms else None
        self._build()

    def _build(self) -> None:
        e = self.policy.engines
        for i in range(e.primary + e.standby):
            self._add(
                Engine(
                    name=f"e{i + 1}",
                    group="serving",
                    role="standby",
                    book=RestartBook(self.policy.restart),
                    memory_mb=e.memory_mb,
                    command=list(e.command),
                )
            )
        for b in e.batch:
            for i in range(b.count):
                self._add(
                    Engine(
                        name=f"{b.name}-{i + 1}",
                        group=b.name,
                        role="batch",
                        book=RestartBook(self.policy.restart),
                        priority=b.priority,
                        memory_mb=b.memory_mb,
                        command=list(b.command or e.command),
                    )
                )

    def _add(self, e: Engine) -> None:
        self.engines[e.name] = e

    @property
    def hang_s(self) -> float:
        hb = self.policy.heartbeat
        return hb.interval_ms * hb.miss_limit / 1000.0

    def silence_s(self, ready: bool) -> float:
        """How long an engine may go without a heartbeat before it is fenced as hung: the
        miss window once it is ready; while it starts (creating a CUDA context holds the
        GIL for a few hundred ms on a busy GPU) heartbeat.starting_silence_ms."""
        if ready:
            return self.hang_s
        return max(self.hang_s, self.policy.heartbeat.starting_silence_ms / 1000.0)

    # ---- publishing ----
    def publish(self, e: Engine, event: str, **data: Any) -> None:
        data.setdefault("pid", e.pid)
        self.bus.emit(
            "engine", e.name, event, self.epoch, role=e.role, state=e.state, port=e.port, **data
        )
        self.bus.state(
            UnitState(
                ts=time.time(),
                kind="engine",
                name=e.name,
                state=e.state,
                epoch=self.epoch,
                role=e.role,
                pid=e.pid,
            )
        )

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
        e.last_beat = time.monotonic()

    def on_heartbeat(self, msg: Heartbeat) -> None:
        found = self._engine_for(msg.name)
        if found is None or not found[1].hello:
            return
        e, inc = found
        e.last_beat = time.monotonic()
        e.in_flight, e.queued = msg.in_flight, msg.queued
        if msg.state in READY_STATES:
            self._ready(e, inc)

    def on_state(self, msg: StateChange) -> None:
        found = self._engine_for(msg.name)
        if found is None or not found[1].hello:
            return
        found[0].last_beat = time.monotonic()
        if msg.state in READY_STATES:
            self._ready(*found)
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

    def on_http_beat(self, e: Engine, inc: Incarnation) -> None:
        if e.inc is inc and not inc.handled:
            inc.hello = True
            e.last_beat = time.monotonic()
            self._ready(e, inc)

    def _ready(self, e: Engine, inc: Incarnation) -> None:
        if inc.ready or e.state != "starting":
            return
        inc.ready = True
        e.state = "batch" if e.role == "batch" else "standby"
        self.publish(e, "ready", start_ms=round((time.monotonic() - inc.started) * 1000, 1))
        self.wake.set()

    # ---- failures ----
    def _exiting(self, name: str, pid: int) -> None:
        """The primary's process `pid` has begun to exit (it runs no more user code): kill
        the rest of its group without waiting for the exits, and promote now."""
        e = self.engines.get(name)
        inc = e.inc if e is not None else None
        if e is None or inc is None or inc.handled or e is not self.primary:
            return
        t_detect = time.monotonic()
        for p in inc.procs:
            p.kill_group()
        rank = next((i for i, p in enumerate(inc.procs) if p.pid == pid), 0)
        self.down(e, inc, cause="exit", detail=f"rank {rank} is exiting", t_detect=t_detect)

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
        """`e` is fenced (its group killed); promote if it was primary, then plan its restart."""
        inc.handled = True
        was_primary = self.primary is e
        e.state, e.in_flight, e.queued = "dead", 0, 0
        if was_primary:
            self.primary = None
            if self.exit_watch is not None:
                self.exit_watch.clear()
            self.view.set(None)
            silent_ms = round((t_detect - e.last_beat) * 1000, 1) if e.last_beat else None
            self._promote_best(t_detect, cause=cause, old=e.name, silent_ms=silent_ms)
        quarantine = counted and e.book.record()
        tail = inc.tail()
        if quarantine:
            e.state = "quarantined"
            self.publish(
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
            self.publish(e, "died", cause=cause, detail=detail, tail=tail, pid=inc.pid)
        e.role = "batch" if e.group != "serving" else "standby"  # published as it died
        self.wake.set()

    async def fence(self, e: Engine, *, cause: str, detail: str, counted: bool = True) -> None:
        """SIGKILL `e`'s process groups, confirm the exit, then handle it as down."""
        inc = e.inc
        if inc is None or inc.handled:
            return
        t_detect = time.monotonic()
        inc.handled = True
        confirmed = all([await p.fence() for p in inc.procs])
        if not confirmed:
            log.error("fence_unconfirmed", engine=e.name, pids=[p.pid for p in inc.procs])
        # before any promotion `down` makes: the event order shows the fence came first
        self.publish(e, "fenced", cause=cause, detail=detail, pid=inc.pid, confirmed=confirmed)
        self.down(e, inc, cause=cause, detail=detail, t_detect=t_detect, counted=counted)

    # ---- promotion ----
    def best_standby(self) -> Engine | None:
        now = time.monotonic()
        ready = [
            e
            for e in self.engines.values()
            if e.state == "standby"
            and e.inc is not None
            and not e.inc.handled
            and now - e.last_beat < self.hang_s
        ]
        return min(ready, key=lambda e: (e.in_flight, now - e.last_beat), default=None)

    def _promote_best(
        self, t_detect: float, *, cause: str, old: str | None, silent_ms: float | None
    ) -> None:
        s = self.best_standby()
        if s is not None:
            self.promote(s, t_detect, cause=cause, old=old, silent_ms=silent_ms)

    def promote(
        self,
        s: Engine,
        t_detect: float,
        *,
        cause: str,
        old: str | None,
        silent_ms: float | None = None,
    ) -> None:
        """Route to `s` and tell it; `silent_ms`: how long the old primary had been silent
        when its loss was detected, `promote_ms`: detection to routed and told."""
        self.epoch += 1
        s.role = s.state = "primary"
        self.primary = s
        if self.exit_watch is not None and s.inc is not None:
            self.exit_watch.watch(s.name, [p.pid for p in s.inc.procs])
        told = self.hub.send(s.name, Promote(epoch=self.epoch)) if self.hub else False
        self.view.set(Target(s.name, s.port, self.epoch), await_ack=told)
        self.publish(
            s,
            "promoted",
            previous=old,
            cause=cause,
            told=told,
            silent_ms=silent_ms,
            promote_ms=round((time.monotonic() - t_detect) * 1000, 3),
        )

    # ---- eviction ----
    async def evict(self, e: Engine, *, reason: str, held: bool) -> None:
        inc = e.inc
        if inc is None or inc.handled or not e.running:
            e.state, e.held = "evicted", held or e.held
            return
        inc.handled = True
        e.state = "draining"
        self.publish(e, "draining", reason=reason)
        grace = self.policy.engines.stop_grace_s
        if self.hub is not None:
            self.hub.send(e.name, Drain(grace_s=grace))
        await asyncio.gather(*(p.terminate(grace) for p in inc.procs))
        e.state, e.held, e.in_flight = "evicted", held, 0
        self.publish(e, "evicted", reason=reason)

    def used_mb(self) -> int:
        return sum(e.memory_mb for e in self.engines.values() if e.running)

    def fits(self, need: int) -> bool:
        cap = self.policy.devices.memory_mb
        return cap == 0 or self.used_mb() + need <= cap

    def running_batch(self) -> list[Engine]:
        """Running batch engines, the first to evict first (lowest priority, newest)."""
        batch = [e for e in self.engines.values() if e.group != "serving" and e.running]
        return sorted(batch, key=lambda e: (e.priority, -(e.inc.started if e.inc else 0.0)))

    # ---- status ----
    def snapshot(self) -> ClusterStatus:
        now = time.monotonic()
        engines = [
            EngineStatus(
                name=e.name,
                role=e.role,
                state=e.state,
                pid=e.pid,
                port=e.port,
                restarts=e.book.total,
                heartbeat_age_ms=e.beat_age_ms(now) if e.running else None,
                in_flight=e.in_flight,
                queued=e.queued,
                pids=[p.pid for p in e.inc.procs] if e.inc else [],
            )
            for e in self.engines.values()
        ]
        daemons = [
            DaemonStatus(
                rank=d.rank,
                state=d.state,
                pid=d.pid,
                fingerprint=d.fingerprint,
                pool_bytes=d.pool_bytes,
                adoptions=d.adoptions,
                adopted=d.adopted,
            )
            for d in (self.daemons.daemons if self.daemons else [])
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
        if self.launcher is None:
            return
        try:
            inc = await self.launcher.spawn(e, self.epoch)
        except StartupError as err:
            e.book.record()
            e.state = "quarantined"
            self.publish(e, "quarantined", cause="spawn", detail=str(err))
            return
        e.inc, e.state, e.last_beat, e.held = inc, "starting", 0.0, False
        e.in_flight = e.queued = 0
        self.publish(e, "starting", restarts=e.book.total)
        early = self.early_hellos.pop(e.name, None)
        if early is not None:
            self.on_hello(early)

    async def stop_all(self) -> None:
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
                e.state = "stopped"
                self.publish(e, "stopped")
        with contextlib.suppress(Exception):
            self.view.set(None)
