"""What the supervisor runs: engines (groups of rank processes) and cache daemons.

These are the supervisor's own mutable records of live things; the policy they come from
and the messages they exchange are frozen structs elsewhere.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from supervisor.backoff import RestartBook
from supervisor.procs import Proc

READY_STATES = frozenset({"ready", "serving"})
RUNNING = frozenset({"starting", "standby", "primary", "batch", "draining"})


@dataclass
class Incarnation:
    """One start of a unit; `handled` is set once its end has been dealt with."""

    procs: list[Proc]
    started: float = field(default_factory=time.monotonic)
    handled: bool = False
    hello: bool = False
    ready: bool = False

    @property
    def pid(self) -> int:
        return self.procs[0].pid if self.procs else 0

    def tail(self, limit: int = 1024) -> str:
        """Rank 0's last output lines, warnings and errors first (see `Proc.tail`)."""
        return self.procs[0].tail(limit) if self.procs else ""


@dataclass
class Engine:
    name: str
    group: str  # "serving", or the batch group's name
    role: str  # primary | standby | batch
    book: RestartBook
    priority: int = 0
    memory_mb: int = 0
    command: list[str] = field(default_factory=list)
    state: str = "dead"  # starting standby batch primary draining evicted dead quarantined
    port: int = 0
    inc: Incarnation | None = None
    last_beat: float = 0.0
    in_flight: int = 0
    queued: int = 0
    held: bool = False  # evicted by hand: stays evicted until `supervisor restart NAME`
    next_start: float = 0.0

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


@dataclass
class Daemon:
    rank: int
    device: str
    book: RestartBook
    state: str = "dead"  # starting serving dead quarantined
    inc: Incarnation | None = None
    spare: Incarnation | None = None  # `cachedaemon serve --spare`, waiting to take over
    fingerprint: str = ""
    pool_bytes: int = 0
    adoptions: int = 0
    adopted: bool = False
    died_at: float = 0.0
    next_start: float = 0.0

    @property
    def pid(self) -> int:
        return self.inc.pid if self.inc is not None and self.state in ("starting", "serving") else 0
