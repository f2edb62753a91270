"""What the supervisor runs: engines (groups of rank processes) and cache daemons.

These are the supervisor's own mutable records of live things; the policy they come from
and the messages they exchange are frozen structs elsewhere.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from holdfast_contract.control import EngineStatus, Wanted, WantedReason, WantedState
from supervisor.backoff import RestartBook
from supervisor.policy import Policy
from supervisor.states import RUNNING, DaemonState, EngineState
from supervisor.versions import Source

# what an engine's agent reports once it may be routed to (its own states, not ours)
READY_STATES = frozenset({"ready", "serving"})


class Handle(Protocol):
    """What the supervisor does with one process (`supervisor.procs.Proc`)."""

    @property
    def pid(self) -> int: ...

    @property
    def alive(self) -> bool: ...

    @property
    def returncode(self) -> int | None: ...

    @property
    def signalled(self) -> bool: ...

    async def wait(self) -> int | None: ...

    def kill_group(self, sig: int = ...) -> None: ...

    async def fence(self, timeout: float = ...) -> bool: ...

    async def terminate(self, grace: float) -> None: ...

    def tail(self, limit: int = ..., window: int = ...) -> str: ...


@dataclass
class Incarnation:
    """One start of a unit; `handled` is set once its end has been dealt with."""

    procs: Sequence[Handle]
    started: float = field(default_factory=time.monotonic)
    handled: bool = False
    hello: bool = False
    ready: bool = False
    # the agent's heartbeat thread (pid, tid; 0: unknown) and how often it had been given a
    # CPU when its last heartbeat came (`pace.thread_runs`)
    beat_thread: tuple[int, int] = (0, 0)
    beat_runs: int | None = None

    @property
    def pid(self) -> int:
        return self.procs[0].pid if self.procs else 0

    def tail(self, limit: int = 1024) -> str:
        """Rank 0's last output lines, warnings and errors first (see `Proc.tail`)."""
        return self.procs[0].tail(limit) if self.procs else ""


@dataclass(frozen=True)
class Want:
    """What the rules want of one engine now, and why (`control.Wanted`, on the monotonic
    clock): `until` is when `reason` ends (a backoff, a respawn hold), None when only a
    change (of load, memory, state) ends it. Decided by `decisions.BatchGovernor.wants`."""

    state: WantedState
    reason: WantedReason
    detail: str
    until: float | None = None

    def wire(self, now: float, wall: float) -> Wanted:
        """As published: `until` on the wall clock, `wall` being `now` on it."""
        until = None if self.until is None else round(wall + self.until - now, 3)
        return Wanted(self.state, self.reason, self.detail, until)


@dataclass
class Engine:
    name: str
    group: str  # "serving", or the batch group's name
    role: str  # primary | standby | batch
    book: RestartBook
    priority: int = 0
    memory_mb: int = 0
    command: list[str] = field(default_factory=list)
    state: EngineState = EngineState.DEAD  # changed only by `states.move`
    port: int = 0
    inc: Incarnation | None = None
    last_beat: float = 0.0
    in_flight: int = 0
    queued: int = 0
    held: bool = False  # evicted by hand: stays evicted until `supervisor restart NAME`
    next_start: float = 0.0
    wanted: Want | None = None  # what the rules want of it, as the last tick decided
    # the pool it starts on: set at its first start (the launcher's), or by an update
    source: Source | None = None

    @property
    def version(self) -> str:
        return self.source.version if self.source is not None else ""

    @property
    def pid(self) -> int:
        return self.inc.pid if self.inc is not None and self.state in RUNNING else 0

    @property
    def running(self) -> bool:
        return self.state in RUNNING

    @property
    def serving(self) -> bool:
        return self.group == "serving"

    def beat_age_ms(self, now: float) -> float | None:
        return round((now - self.last_beat) * 1000.0, 1) if self.last_beat else None

    def status(self, now: float, wall: float) -> EngineStatus:
        """As `supervisor status` and /cluster show it; `now` (monotonic) is `wall` (the
        wall clock)."""
        return EngineStatus(
            name=self.name,
            role=self.role,
            state=self.state,
            pid=self.pid,
            port=self.port,
            restarts=self.book.total,
            heartbeat_age_ms=self.beat_age_ms(now) if self.running else None,
            in_flight=self.in_flight,
            queued=self.queued,
            pids=[p.pid for p in self.inc.procs] if self.inc else [],
            wanted=self.wanted.wire(now, wall) if self.wanted is not None else None,
            version=self.version,
        )


LIVE_DAEMON = frozenset({DaemonState.STARTING, DaemonState.SERVING})


@dataclass
class Daemon:
    rank: int
    device: str
    book: RestartBook
    state: DaemonState = DaemonState.DEAD  # changed only by `states.move`
    inc: Incarnation | None = None
    spare: Incarnation | None = None  # `cachedaemon serve --spare`, waiting to take over
    fingerprint: str = ""
    pool_bytes: int = 0
    adoptions: int = 0
    adopted: bool = False
    died_at: float = 0.0
    next_start: float = 0.0
    spawning: bool = False  # a start is under way (its process not spawned yet)
    # how the checkpoint files on disk differ from those its pool was loaded from
    checkpoint_changed: tuple[str, ...] = ()
    version: str = ""  # of the pool it serves (`versions.version_of`)

    @property
    def pid(self) -> int:
        return self.inc.pid if self.inc is not None and self.state in LIVE_DAEMON else 0


def engines_of(policy: Policy) -> list[Engine]:
    """The engines a policy asks for: e1..eN serving (primary + standbys), then each batch
    group's `<name>-1..count`; all dead until the reconcile loop starts them."""
    e = policy.engines
    serving = [
        Engine(
            name=f"e{i + 1}",
            group="serving",
            role="standby",
            book=RestartBook(policy.restart),
            memory_mb=e.memory_mb,
            command=list(e.command),
        )
        for i in range(e.primary + e.standby)
    ]
    batch = [
        Engine(
            name=f"{b.name}-{i + 1}",
            group=b.name,
            role="batch",
            book=RestartBook(policy.restart),
            priority=b.priority,
            memory_mb=b.memory_mb,
            command=list(b.command or e.command),
        )
        for b in e.batch
        for i in range(b.count)
    ]
    return serving + batch
