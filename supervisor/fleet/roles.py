"""A node's role in the election, and the one table of legal moves between roles.

`ROLE` is a `supervisor.states.Table` like the engines' and daemons': rows of (from,
event, to, action), where `action` is the `Elector` method that makes the move. The
elector is the role's one owner; a move that is not a row raises `IllegalTransition`
(a bug in the elector). Events are `Event` members, and each change is handed to
`on_change` as a `Change`: an `Event`, or for a step-down the `StepDown` that says why.
`str(change)` is the name it has always been published under: `"won"`,
`"stepped_down.renewal_stale"` (the elector's log, `python -m supervisor.fleet elect`);
`StepDown.reason` (`"yield_to_n2"`) is the node's `stepped-down` event's reason.
"""

from __future__ import annotations

from enum import StrEnum

import msgspec

from supervisor.states import Table


class Role(StrEnum):
    STARTING = "starting"  # no etcd session yet (or between sessions)
    FOLLOWER = "follower"  # in a session, not leader
    LEADER = "leader"  # holds the leader key and its renewal is fresh
    FAILED = "failed"  # refused to join (duplicate node name, fingerprint mismatch)
    STOPPED = "stopped"


class Event(StrEnum):
    """What the elector reports: each a row of `ROLE`, but `LEADER`, which changes no
    role (the leader this node sees changed: what a router follows)."""

    JOINED = "joined"
    REFUSED = "refused"
    WON = "won"
    RESUMED = "resumed"  # a lapsed term whose key outlived it
    SESSION_LOST = "session_lost"
    STEPPED_DOWN = "stepped_down"
    STOP = "stop"
    LEADER = "leader"


class Why(StrEnum):
    """Why a leader stepped down (docs/fleet.md, "Leaving leadership")."""

    RENEWAL_STALE = "renewal_stale"  # its last successful renewal is older than hold_s
    RENEWAL_LATE = "renewal_late"  # a renewal answered only past the term's deadline
    KEY_GONE = "key_gone"  # its leader key was deleted
    KEY_REPLACED = "key_replaced"  # another term's key is there
    YIELD = "yield_to"  # handed over to `StepDown.to`
    SESSION_LOST = "session_lost"
    STOP = "stop"


class StepDown(msgspec.Struct, frozen=True):
    """One step-down: when (the elector's clock), why, and the lease's deadline then."""

    at: float
    why: Why
    lease_deadline: float
    to: str = ""  # Why.YIELD: the node handed to

    @property
    def reason(self) -> str:
        """As published: the `Why`, `yield_to_<node>` for a hand-over."""
        return f"{self.why}_{self.to}" if self.why is Why.YIELD else str(self.why)

    @property
    def lapsed(self) -> bool:
        """The term lapsed for want of a fresh renewal: it may resume (Elector._resume)."""
        return self.why in (Why.RENEWAL_STALE, Why.RENEWAL_LATE)

    def __str__(self) -> str:
        return f"{Event.STEPPED_DOWN}.{self.reason}"


Change = Event | StepDown


def event_of(change: Change) -> Event:
    """The table's event for a change (a step-down's is `STEPPED_DOWN`)."""
    return Event.STEPPED_DOWN if isinstance(change, StepDown) else change


R, V = Role, Event
ROLE = Table[Role, Event](
    "fleet role",
    [
        (R.STARTING, V.JOINED, R.FOLLOWER, "_session"),
        (R.STARTING, V.REFUSED, R.FAILED, "_run"),
        (R.STARTING, V.STOP, R.STOPPED, "__aexit__"),
        (R.FOLLOWER, V.WON, R.LEADER, "_campaign"),
        (R.FOLLOWER, V.RESUMED, R.LEADER, "_resume"),
        (R.FOLLOWER, V.SESSION_LOST, R.STARTING, "_run"),
        (R.FOLLOWER, V.STOP, R.STOPPED, "__aexit__"),
        (R.LEADER, V.STEPPED_DOWN, R.FOLLOWER, "_step_down"),
        (R.LEADER, V.STOP, R.STOPPED, "__aexit__"),
        (R.FAILED, V.STOP, R.FAILED, "__aexit__"),
    ],
    home="supervisor/fleet/roles.py",
)
