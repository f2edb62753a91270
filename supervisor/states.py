"""Engine and daemon states, and the one table of legal moves between them.

Each row is (from, event, to, action): in state `from`, the supervisor's method `action`
carries out `event`, the unit enters `to`, and `event` is published under that name
(`engine.<name>.<event>`, `daemon.<rank>.<event>`; the names are
`holdfast_contract.events.EventName`). `move()` is the only code that
changes a unit's state; a move that is not a row raises `IllegalTransition`, which is
a supervisor bug, never an operator error. `Table` is generic in the states and the
events: the fleet's roles use it too (`supervisor/fleet/roles.py`, events an enum).

States are `StrEnum`s, so a state compares equal to, and is published as, the same
string as before (`"standby"`), in events, `supervisor status` and MQTT.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Generic, Protocol, TypeVar

from holdfast_contract.events import EventName
from supervisor.errors import SupervisorError


class EngineState(StrEnum):
    STARTING = "starting"
    STANDBY = "standby"
    BATCH = "batch"
    PRIMARY = "primary"
    DRAINING = "draining"
    EVICTED = "evicted"
    DEAD = "dead"
    QUARANTINED = "quarantined"
    STOPPED = "stopped"


class DaemonState(StrEnum):
    STARTING = "starting"
    SERVING = "serving"
    DEAD = "dead"
    QUARANTINED = "quarantined"
    STOPPED = "stopped"


S = TypeVar("S", bound=StrEnum)
V = TypeVar("V", bound=str)  # the events: names (engines, daemons) or an enum of them


class IllegalTransition(SupervisorError):
    """A move the table does not allow: the supervisor's own bug."""


@dataclass(frozen=True)
class Row(Generic[S, V]):
    src: S
    event: V
    dst: S
    # the owner's method that does it: Crew (engines), CacheDaemons (daemons), Elector (roles)
    action: str


class Stateful(Protocol[S]):
    state: S


class Table(Generic[S, V]):
    """Rows keyed by (from, event, to); `to` may be left out where only one row fits.
    `home`: the file that lists the rows (named when a move is refused)."""

    def __init__(
        self, kind: str, rows: list[tuple[S, V, S, str]], home: str = "supervisor/states.py"
    ) -> None:
        self.kind, self.home = kind, home
        self.rows: tuple[Row[S, V], ...] = tuple(Row(*r) for r in rows)
        self._by_key: dict[tuple[S, V, S], Row[S, V]] = {
            (r.src, r.event, r.dst): r for r in self.rows
        }
        if len(self._by_key) != len(self.rows):
            raise IllegalTransition(f"the {kind} table lists a (from, event, to) twice")
        # (from, event) -> its rows: a lookup on a promotion's path is one dict read
        by_event: dict[tuple[S, V], list[Row[S, V]]] = {}
        for row in self.rows:
            by_event.setdefault((row.src, row.event), []).append(row)
        self._by_event: dict[tuple[S, V], tuple[Row[S, V], ...]] = {
            key: tuple(found) for key, found in by_event.items()
        }

    def lookup(self, src: S, event: V, dst: S | None = None) -> Row[S, V]:
        rows = self._by_event.get((src, event), ())
        fits = rows if dst is None else tuple(r for r in rows if r.dst == dst)
        if len(fits) != 1:
            to = f" to {dst}" if dst is not None else ""
            why = "no row" if not fits else f"{len(fits)} rows (name the target state)"
            raise IllegalTransition(
                f"{self.kind}: {str(event)!r} from {src}{to}: {why} in {self.home}"
            )
        return fits[0]

    def events(self) -> frozenset[V]:
        return frozenset(r.event for r in self.rows)


def move(unit: Stateful[S], table: Table[S, V], event: V, dst: S | None = None) -> Row[S, V]:
    """Change `unit`'s state by the row for (its state, `event`, `dst`); the row used."""
    row = table.lookup(unit.state, event, dst)
    unit.state = row.dst
    return row


E = EngineState
N = EventName
_RUNNING_ENGINE = (E.STARTING, E.STANDBY, E.BATCH, E.PRIMARY)
_RETIRABLE = (E.STARTING, E.STANDBY, E.BATCH, E.DRAINING, E.DEAD, E.QUARANTINED, E.EVICTED)

ENGINE = Table[EngineState, EventName](
    "engine",
    [
        # a start: a new incarnation spawned (a restart, a respawn after eviction)
        (E.DEAD, N.STARTING, E.STARTING, "spawn"),
        (E.EVICTED, N.STARTING, E.STARTING, "spawn"),
        (E.DEAD, N.QUARANTINED, E.QUARANTINED, "spawn"),  # its command cannot start
        (E.EVICTED, N.QUARANTINED, E.QUARANTINED, "spawn"),
        # ready: attached, warmed up and listening; routed only once promoted
        (E.STARTING, N.READY, E.STANDBY, "ready"),
        (E.STARTING, N.READY, E.BATCH, "ready"),
        (E.STANDBY, N.PROMOTED, E.PRIMARY, "promote"),
        # a new epoch from the fleet (this node's term won or resumed): told, routed again
        (E.PRIMARY, N.EPOCH_RAISED, E.PRIMARY, "raise_epoch"),
        # losses: a rank exited, or the supervisor fenced it (hang, not ready, refused)
        *[(s, N.DIED, E.DEAD, "down") for s in _RUNNING_ENGINE],
        *[(s, N.QUARANTINED, E.QUARANTINED, "down") for s in _RUNNING_ENGINE],
        (E.PRIMARY, N.FENCED, E.DEAD, "hand_over"),  # `supervisor promote` of another
        # batch engines leave for load or admission, or by hand (`supervisor evict`)
        (E.STARTING, N.DRAINING, E.DRAINING, "evict"),
        (E.BATCH, N.DRAINING, E.DRAINING, "evict"),
        (E.DRAINING, N.EVICTED, E.EVICTED, "evict"),
        (E.DEAD, N.EVICTED, E.EVICTED, "evict"),
        (E.QUARANTINED, N.EVICTED, E.EVICTED, "evict"),
        # `supervisor restart NAME`: back to dead, due now, its restart count forgotten
        (E.DEAD, N.RESTARTING, E.DEAD, "restart"),  # one that died, or was fenced by it
        (E.EVICTED, N.RESTARTING, E.DEAD, "restart"),
        (E.QUARANTINED, N.RESTARTING, E.DEAD, "restart"),
        # a rolling update: the old primary, routed no more, finishes its requests; the
        # engines of a version no longer served leave the crew (supervisor/update/)
        (E.PRIMARY, N.SUPERSEDED, E.DRAINING, "switch"),
        (E.DRAINING, N.REFITTED, E.STANDBY, "rejoin"),
        *[(s, N.RETIRED, E.STOPPED, "retire") for s in _RETIRABLE],
        # the supervisor stops
        *[(s, N.STOPPED, E.STOPPED, "stop_all") for s in (*_RUNNING_ENGINE, E.DRAINING)],
    ],
)

D = DaemonState
_RUNNING_DAEMON = (D.STARTING, D.SERVING)
DAEMON = Table[DaemonState, EventName](
    "daemon",
    [
        (D.DEAD, N.STARTING, D.STARTING, "follow"),  # a new process, or its spare took over
        (D.STARTING, N.SERVING, D.SERVING, "served"),
        # an exit: dead (restarted after its backoff, or by its spare), or quarantined
        *[(s, N.DEAD, D.DEAD, "exited") for s in _RUNNING_DAEMON],
        *[(s, N.QUARANTINED, D.QUARANTINED, "exited") for s in _RUNNING_DAEMON],
        # the supervisor stops
        *[(s, N.STOPPED, D.STOPPED, "stop") for s in (*_RUNNING_DAEMON, D.DEAD, D.QUARANTINED)],
    ],
)

RUNNING = frozenset({*_RUNNING_ENGINE, E.DRAINING})
