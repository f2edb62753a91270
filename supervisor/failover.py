"""The failover core: an engine lost, fenced, and its standby promoted.

Losing the primary is handled in the same call that sees it: fence (SIGKILL its process
group, seen killed), epoch += 1, route to the best standby, tell it to promote, publish;
the replacement standby comes from the reconcile loop's next tick. `Failover` does each
step through the state table (`Roster._move`); whom to promote is decided in
`decisions.best_standby`. `CpuMark` measures how much of a promotion the supervisor spent
on a CPU, `Cost` what it cost in all.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import structlog

from holdfast_contract.agent_protocol import Promote, kv_key
from holdfast_contract.events import EventName as N
from supervisor.errors import ControlError
from supervisor.events import EventBus
from supervisor.exitwatch import Death, ExitWatch, Sight, first_death, is_exiting
from supervisor.policy import Policy
from supervisor.primary import PrimaryView, Target
from supervisor.priority import renice
from supervisor.realtime import RealtimeSection
from supervisor.roster import Roster
from supervisor.states import ENGINE, EngineState
from supervisor.units import Engine, Incarnation
from supervisor.wiring import Commands, Term

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


class Cost(NamedTuple):
    """What a promotion cost, as its `promoted` event says (see `Failover.promote`)."""

    promote_ms: float
    promote_cpu_ms: float | None
    promote_realtime: bool


class Failover(Roster):
    """Losses (an exit, a fence) and promotions of the roster's engines."""

    def __init__(
        self, policy: Policy, bus: EventBus, view: PrimaryView, term: Term, hub: Commands
    ) -> None:
        super().__init__(policy, bus, view, term)
        self.hub = hub
        poll_ms = policy.heartbeat.exit_poll_ms
        self.realtime = RealtimeSection(policy.heartbeat.realtime_promotion)
        self.exit_watch = (
            ExitWatch(poll_ms / 1000.0, self._exiting, self.realtime) if poll_ms else None
        )

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
            self._promote_best(
                t_detect, cause=cause, old=e.name, silent_ms=silent_ms, cpu=cpu, dead=e
            )
            if self.primary is None:  # none promoted: nothing to route to
                self.view.set(None)  # (a promotion routes to its own at once)
                if self.exit_watch is not None:
                    self.exit_watch.clear()  # (and a promotion watches its own)
        tail = inc.tail()
        if counted and e.book.record():
            self._move(
                e,
                N.QUARANTINED,
                cause=cause,
                detail=detail,
                tail=tail,
                restarts=e.book.recent(),
                pid=inc.pid,
            )
        else:
            e.next_start = time.monotonic() + (e.book.delay() if counted else 0.0)
            self._move(e, N.DIED, cause=cause, detail=detail, tail=tail, pid=inc.pid)
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
        self.publish(e, N.FENCED, cause=cause, detail=detail, pid=inc.pid, confirmed=confirmed)
        self.down(e, inc, cause=cause, detail=detail, t_detect=t_detect, counted=counted)
        self.realtime.leave()  # (no standby was promoted)

    async def _kill(self, e: Engine, inc: Incarnation) -> bool:
        confirmed = all([await p.fence() for p in inc.procs])
        if not confirmed:
            log.error("fence_unconfirmed", engine=e.name, pids=[p.pid for p in inc.procs])
        return confirmed

    # ---- promotion ----
    def _promote_best(
        self,
        t_detect: float,
        *,
        cause: str,
        old: str | None,
        silent_ms: float | None,
        cpu: CpuMark | None = None,
        dead: Engine | None = None,
    ) -> None:
        s = self.best_standby()
        if s is not None:
            self.promote(s, t_detect, cause=cause, old=old, silent_ms=silent_ms, cpu=cpu, dead=dead)

    def promote(
        self,
        s: Engine,
        t_detect: float,
        *,
        cause: str,
        old: str | None,
        silent_ms: float | None = None,
        cpu: CpuMark | None = None,
        dead: Engine | None = None,
    ) -> None:
        """standby -> primary: route to `s` and tell it (with engines.kv_adopt, to take
        over the KV cache of `dead`, the primary just fenced or exited, if it served the
        same version); `silent_ms`: how long the old
        primary had been silent when its loss was detected, `promote_ms`: detection to
        routed and told; with `cpu` (taken as `down` began: after a fence's kill, which
        `promote_ms` includes), how much of that the supervisor spent on a CPU
        (`promote_cpu_ms`; the rest it waited, descheduled or blocked): what tells a slow
        promotion from a descheduled one; `promote_realtime`: whether it ran as
        SCHED_FIFO (`supervisor.realtime`)."""
        ENGINE.lookup(s.state, N.PROMOTED)  # raises before anything is done for `s`
        self.epoch += 1
        s.role = "primary"
        self.primary = s
        adopt = dead is not None and self.policy.engines.kv_adopt and dead.version == s.version
        told = self._route_to(s, kv=kv_key(dead.name) if adopt and dead is not None else "")
        cost = self._cost(t_detect, cpu)
        self.realtime.leave()  # (entered where the loss was seen, if it was)
        if s.inc is not None and self.policy.engines.primary_nice:  # before it is said
            renice([p.pid for p in s.inc.procs], self.policy.engines.primary_nice)
        self._move(
            s,
            N.PROMOTED,
            previous=old,
            cause=cause,
            told=told,
            silent_ms=silent_ms,
            kv_from=dead.name if adopt and dead is not None else None,
            **cost._asdict(),
        )
        if self.exit_watch is not None and s.inc is not None:  # once routed and told
            self.exit_watch.watch(s.name, [p.pid for p in s.inc.procs])

    def _cost(self, t_detect: float, cpu: CpuMark | None) -> Cost:
        """What a promotion cost once routed and told; read before the real-time section
        is left."""
        cpu_ms = cpu.since() if cpu is not None else None  # (inside the wall-clock window)
        promote_ms = round((time.monotonic() - t_detect) * 1000, 3)
        return Cost(promote_ms, cpu_ms, self.realtime.held)

    def _route_to(self, p: Engine, kv: str = "") -> bool:
        """Tell `p` to serve at the current epoch (taking over the KV cache the keeper
        holds under `kv`, if any) and route to it (the router waits for its ack if it
        was told); whether it was told."""
        ident = self.kv_held(kv) if kv else ""
        told = self.hub.send(p.name, Promote(epoch=self.epoch, kv=kv, kv_ident=ident))
        self.view.set(Target(p.name, p.port, self.epoch, version=p.version), await_ack=told)
        return told

    def kv_held(self, key: str) -> str:
        """Which KV cache the keeper holds under `key` now (`Promote.kv_ident`: a standby
        holding that one already takes it without asking the keeper); "" where unknown."""
        return ""

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
        self._move(p, N.EPOCH_RAISED, cluster_epoch=cluster_epoch, told=told)

    def switch(self, new: Engine, *, continues: bool = False) -> Engine | None:
        """A rolling update's one step: `new`, a ready standby of the next version, becomes
        primary at epoch + 1 and its version the one served; the old primary is routed no
        more but not killed (primary -> draining, `superseded`): its requests in flight
        finish there (supervisor/update/), or with `continues` (a refit's retry), the
        router may go on with what is cut there on `new`. The old primary, if there was
        one."""
        if new.state != S.STANDBY:
            raise ControlError(f"{new.name} is {new.state}; only a ready standby takes over")
        old, t0 = self.primary, time.monotonic()
        self.view.continues = {(self.version, new.version)} if continues else set()
        if old is not None and old.inc is not None:
            old.inc.handled = True  # its exit, when it comes, is no loss
            self.primary = None
            self._move(old, N.SUPERSEDED, by=new.name, version=old.version, next=new.version)
            old.role = "standby"  # as after `supervisor promote`; `superseded` says what it was
        self.version = new.version
        self.promote(new, t0, cause="update", old=old.name if old else None)
        self.wake.set()
        return old

    def serve_version(self, version: str) -> None:
        """The primary was refitted where it serves (supervisor/update/refit.py): its new
        version is the one served, and the router's from now on."""
        self.version = version
        if self.primary is not None and self.primary.state == S.PRIMARY:
            self._route_to(self.primary)

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
            self._move(old, N.FENCED, cause="operator-promote", pid=inc.pid)
            old.role = "standby"  # it restarts as one; `fenced` says what it was
        self.promote(new, t0, cause="operator", old=old.name if old else None, dead=old)
        self.wake.set()
