"""Operator commands to the supervisor and what it answers: the control socket's messages
(`ipc://<run>/control`) and the crew's status that `supervisor status` and the health
API's /cluster show.

A client sends one tagged msgpack request; the supervisor answers one `ControlReply`.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class ControlRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag=True):
    """The base of every request; `Request` is the union the supervisor decodes."""


class StatusReq(ControlRequest, frozen=True):
    pass


class StopReq(ControlRequest, frozen=True):
    pass


class PromoteReq(ControlRequest, frozen=True):
    name: str


class EvictReq(ControlRequest, frozen=True):
    name: str


class RestartReq(ControlRequest, frozen=True):
    name: str


class UpdateReq(ControlRequest, frozen=True):
    """`supervisor update --model DIR`: a rolling update to the checkpoint in `model` (an
    absolute path); `dtype` and `quantization` None: the running pool's."""

    model: str
    dtype: str | None = None
    quantization: str | None = None


class RollbackReq(ControlRequest, frozen=True):
    pass


class RefitReq(ControlRequest, frozen=True):
    """`supervisor refit --model DIR`: new weights of the same names and shapes (a
    safetensors dir, an absolute path) into a new pool; every engine switches to it in
    place, without a restart (supervisor/update/refit.py)."""

    model: str


Request = (
    StatusReq | PromoteReq | EvictReq | RestartReq | StopReq | UpdateReq | RollbackReq | RefitReq
)
# a request with this header is answered by a standby too: an update's smoke request
SMOKE_HEADER = "X-Holdfast-Smoke"
# on a continuation's answer (a completion naming `holdfast_warm`): the prompt positions
# whose keys and values the engine had kept for it (a past kept warm, or adopted from a dead
# primary's KV cache); the rest its prefill computes
KEPT_HEADER = "X-Holdfast-Kept"
# the model version that made an answer: the router's, or a refitted engine's own
VERSION_HEADER = "X-Holdfast-Model-Version"


WantedState = Literal["running", "stopped"]
# why, for running: policy (nothing keeps it out), backoff (its restart backoff ends at
# `until`), respawn-hold (evicted; back at `until` if the load stays low); for stopped:
# load-high (primary load over evict_above), load-not-low (evicted; the load not yet under
# respawn_below), held (evicted by hand), memory-cap (does not fit devices.memory_mb),
# quarantined (restarted too often), evicting (on its way out), stopping (the supervisor)
WantedReason = Literal[
    "policy",
    "backoff",
    "respawn-hold",
    "load-high",
    "load-not-low",
    "held",
    "memory-cap",
    "quarantined",
    "evicting",
    "stopping",
]


class Wanted(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the supervisor's rules want of one engine now, and why: decided for every
    engine by `supervisor.decisions.BatchGovernor.wants` each reconcile tick, published in
    `EngineStatus.wanted` and the engine's retained MQTT state."""

    state: WantedState
    reason: WantedReason
    detail: str = ""  # for a person: the rule and the policy key behind it
    until: float | None = None  # wall clock (time.time()) at which `reason` ends


class EngineStatus(msgspec.Struct, frozen=True):
    name: str
    role: str
    state: str
    pid: int
    port: int
    restarts: int
    heartbeat_age_ms: float | None
    in_flight: int = 0
    queued: int = 0  # accepted, waiting for the engine's KV cache (from heartbeats)
    pids: list[int] = []  # one per tensor-parallel rank; pid is rank 0's
    wanted: Wanted | None = None  # None until the supervisor's first decision about it
    version: str = ""  # the model version of the pool it runs on ("" before its first start)


class DaemonStatus(msgspec.Struct, frozen=True):
    rank: int
    state: str
    pid: int
    fingerprint: str
    pool_bytes: int
    adoptions: int
    adopted: bool = False
    # each checkpoint file that changed on disk since the pool was loaded, and how
    checkpoint_changed: list[str] = []
    version: str = ""  # the model version of its pool (supervisor/versions.py)
    generation: int = 1  # one more with each update: its own sockets, <run>/gen-<n>/


UpdateState = Literal[
    "building", "warming", "refitting", "switching", "draining", "keeping", "rolling-back"
]


class UpdateStatus(msgspec.Struct, frozen=True):
    """The rolling model update under way, or the last one (`supervisor status`)."""

    state: UpdateState | Literal["finished", "rolled-back"]
    version_from: str
    version_to: str
    model: str  # the checkpoint dir it goes to
    detail: str = ""  # why it rolled back; what it waits for
    started: float = 0.0  # wall clock
    keep_until: float | None = None  # wall clock: the old pool is freed then (`keeping`)
    kind: Literal["update", "refit"] = "update"  # new engines switched in, or engines refitted


class FleetNodeStatus(msgspec.Struct, frozen=True):
    """One node of a fleet, as its leader's lease and the nodes' keys in etcd say."""

    node: str
    role: str  # leader | follower
    healthy: bool
    priority: int
    router: str
    api: str
    host: str
    pid: int


class FleetStatus(msgspec.Struct, frozen=True):
    """A fleet node's view of its cluster (the health API's /cluster on top of the crew's;
    docs/fleet.md lists the keys)."""

    cluster: str
    node: str
    role: str  # starting | leader | follower | ...
    healthy: bool
    epoch: int
    cluster_epoch: int
    leader: str | None = None
    leader_router: str | None = None
    lease_age_s: float | None = None
    nodes: list[FleetNodeStatus] = []


class CrewStatus(msgspec.Struct, frozen=True):
    """This node's engines and cache daemons (`supervisor status --json`, /cluster)."""

    epoch: int
    primary: str | None
    engines: list[EngineStatus]
    daemons: list[DaemonStatus]
    events: int = 0
    events_dropped: int = 0
    mqtt_connected: bool = False
    version: str = ""  # the model version the router's primary serves
    update: UpdateStatus | None = None  # the rolling update under way, or the last one

    def in_state(self, state: str) -> list[EngineStatus]:
        """The engines in `state` that have a process."""
        return [e for e in self.engines if e.state == state and e.pid]

    def engine(self, name: str) -> EngineStatus | None:
        return next((e for e in self.engines if e.name == name), None)


class ControlReply(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    ok: bool
    message: str = ""
    status: CrewStatus | None = None


_req_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(ControlReply)
_status_decoder = msgspec.json.Decoder(CrewStatus)


def encode(msg: ControlRequest | ControlReply) -> bytes:
    return msgspec.msgpack.encode(msg)


def decode_request(data: bytes) -> Request:
    """Raises msgspec.DecodeError on garbage."""
    req: Request = _req_decoder.decode(data)
    return req


def decode_reply(data: bytes) -> ControlReply:
    return _reply_decoder.decode(data)


def decode_status_json(data: bytes) -> CrewStatus:
    """The health API's /cluster body; raises msgspec.DecodeError on garbage."""
    return _status_decoder.decode(data)
