"""Supervisor events as they travel: JSON on the zmq PUB socket `ipc://<run>/events` and
on MQTT; the chaos suite and tests read them back with `decode_event`. `EventName` names
every event the supervisor publishes, for the supervisor, its metrics and the chaos suite
alike."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

import msgspec


class EventName(StrEnum):
    """The `<event>` of `<kind>.<name>.<event>`. A `StrEnum`: each compares equal to, and
    is published as, its value, which MQTT consumers match: a value never changes."""

    # engines' and daemons' moves (the rows of supervisor/states.py `ENGINE`, `DAEMON`)
    STARTING = "starting"
    READY = "ready"
    PROMOTED = "promoted"
    EPOCH_RAISED = "epoch-raised"
    DIED = "died"
    QUARANTINED = "quarantined"
    FENCED = "fenced"
    DRAINING = "draining"
    EVICTED = "evicted"
    RESTARTING = "restarting"
    STOPPED = "stopped"
    SUPERSEDED = "superseded"  # an update's old primary: routed no more, finishing its requests
    RETIRED = "retired"  # an engine of a version no longer served, gone from the crew
    REFITTED = "refitted"  # an engine maps a refit's new pool, without a restart
    SERVING = "serving"
    DEAD = "dead"
    # an engine's, beside its moves (and `reported-<state>`, what its agent reported)
    STRAY_HELLO = "stray-hello"
    COMMAND_FAILED = "command-failed"
    KV_ADOPTED = "kv-adopted"  # promoted over a dead primary, it took over that one's KV cache
    KV_NOT_ADOPTED = "kv-not-adopted"  # ... asked to, it did not (why): its streams replay
    # a daemon's, beside its moves
    HUNG = "hung"
    SPARE_READY = "spare_ready"
    CHECKPOINT_CHANGED = "checkpoint_changed"
    STALE_HANDOUT = "stale_handout"
    # the supervisor's own (`supervisor.main.<event>`; also `starting`, `stopped`)
    DAEMONS_READY = "daemons-ready"
    STARTED = "started"
    STOPPING = "stopping"
    # a rolling model update's (`update.main.<event>`, supervisor/update/; also `started`,
    # `ready`)
    SWITCHED = "switched"
    ROLLED_BACK = "rolled-back"
    FINISHED = "finished"
    POOL_FREED = "pool-freed"  # an old or refused version's daemons stopped, its escrow withdrawn
    # the router's (`router.<node or main>.<event>`, supervisor/proxy/cuts.py)
    MIGRATING = "migrating"
    MIGRATED = "migrated"
    MIGRATION_FAILED = "migration-failed"
    # the fleet's (`fleet.<node>.<event>`, supervisor/fleet/node.py)
    HEALTH = "health"
    ETCD_UNREACHABLE = "etcd-unreachable"
    JOINED = "joined"
    JOIN_REFUSED = "join-refused"
    BECAME_LEADER = "became-leader"
    RESUMED_LEADER = "resumed-leader"
    STEPPED_DOWN = "stepped-down"
    LEASE_LOST = "lease-lost"
    LEADER_VACANT = "leader-vacant"
    LEADER_ELECTED = "leader-elected"
    FOLLOWER_OF = "follower-of"
    STOP = "stop"


class Event(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One state change. Topic-style name: `<kind>.<name>.<event>` (engine.e1.promoted)."""

    ts: float
    kind: str  # engine | daemon | supervisor | broker | router | fleet | update
    name: str
    event: str
    epoch: int
    data: dict[str, Any] = {}

    @property
    def topic(self) -> str:
        return f"{self.kind}.{self.name}.{self.event}"


_event_decoder: msgspec.json.Decoder[Event] = msgspec.json.Decoder(Event)


def encode_event(ev: Event) -> bytes:
    return msgspec.json.encode(ev)


def decode_event(data: bytes) -> Event:
    return _event_decoder.decode(data)
