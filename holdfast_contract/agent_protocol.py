"""Messages between the supervisor and its agents (engines, daemons) over zmq.

Each zmq message is one msgpack frame holding one tagged struct. Engines talk through a
DEALER socket (identity = their name) to the supervisor's ROUTER at HOLDFAST_AGENT: the
engine side is `engine.agent_client`, the supervisor side `supervisor.agent_hub`.
"""

from __future__ import annotations

from typing import Any

import msgspec


class _Msg(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag=True):
    pass


# ---- agent -> supervisor ----
class Hello(_Msg, frozen=True):
    name: str
    role: str  # primary | standby | batch
    pid: int
    port: int
    epoch: int
    tid: int = 0  # the heartbeat thread's native id (0: unknown), for the supervisor's look


class Heartbeat(_Msg, frozen=True):
    name: str
    seq: int
    state: str  # starting | ready | serving | draining
    in_flight: int
    queued: int
    epoch: int


class StateChange(_Msg, frozen=True):
    name: str
    state: str
    detail: str = ""


class Ack(_Msg, frozen=True):
    """The answer to one command: whether the engine carried it out."""

    name: str
    command: str
    ok: bool
    detail: str = ""
    # a Promote naming a dead engine's KV cache (`Promote.kv`): the streams whose pasts
    # this engine took over from it, or None when it was not taken over (`kv_why`)
    kv_streams: int | None = None
    kv_why: str = ""


class Refitted(_Msg, frozen=True):
    """The end of one Refit: the engine serves `version` now (ok), or still the one it
    served before, `detail` saying why not."""

    name: str
    version: str
    ok: bool
    detail: str = ""
    ms: float = 0.0  # from the command to serving again
    swap_ms: float = 0.0  # the remap itself, at a step boundary
    cut: int = 0  # requests in flight ended with an error at grace_s


# ---- supervisor -> agent ----
class Stop(_Msg, frozen=True):
    """Stop now: drain with the engine's own grace period, then exit."""


class Promote(_Msg, frozen=True):
    """Serve as the primary from now on, under fencing token `epoch`."""

    epoch: int
    # the dead primary's KV cache in the keeper (engine/kvshare.py), to take over before
    # the ack; "": none (the engine takes a fresh cache if it shares one)
    kv: str = ""
    # which cache the keeper held under `kv` when the promotion was decided: a standby
    # that holds that one already (engine/kvahead.py) asks the keeper nothing
    kv_ident: str = ""


class Drain(_Msg, frozen=True):
    """Take no new requests; finish those in flight within `grace_s`, then exit."""

    grace_s: float


class Refit(_Msg, frozen=True):
    """Serve the weights of the pool at `socket` (same names, shapes and layout as the
    one this engine maps) from now on, without a restart: take no new requests, finish
    those in flight within `grace_s` (past it they end with an error), map the new pool at
    the old one's addresses at a step boundary, then serve again as `version`. The end is
    a Refitted message."""

    socket: str
    model: str  # the checkpoint dir that pool was loaded from
    version: str
    grace_s: float
    hold: bool = False  # new requests wait for the swap (True) or are refused with 503
    # the requests in flight are cut at once (their connections closed, their generation
    # stopped) rather than finished: the router answers them from the new weights
    cut: bool = False


def kv_key(engine: str) -> str:
    """Where the keeper holds `engine`'s shared KV cache and ledger (`Promote.kv`)."""
    return f"kv/{engine}"


AgentMessage = Hello | Heartbeat | StateChange | Ack | Refitted
Command = Promote | Drain | Stop | Refit

_encoder = msgspec.msgpack.Encoder()
_agent_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(AgentMessage)
_command_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(Command)


def encode(msg: _Msg) -> bytes:
    return _encoder.encode(msg)


def decode_agent(data: bytes) -> Hello | Heartbeat | StateChange | Ack | Refitted:
    """Raises msgspec.DecodeError on garbage; callers drop and count such frames."""
    msg: Hello | Heartbeat | StateChange | Ack | Refitted = _agent_decoder.decode(data)
    return msg


def decode_command(data: bytes) -> Promote | Drain | Stop | Refit:
    msg: Promote | Drain | Stop | Refit = _command_decoder.decode(data)
    return msg
