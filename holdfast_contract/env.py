"""The environment the supervisor gives each engine process: one struct, one reader.

Every field of `EngineEnv` is one variable, named `HOLDFAST_` + the field in capitals
(`port` is `HOLDFAST_PORT`). The supervisor writes them with `to_environ`; an engine reads
them with `read_env`, which parses and checks each one and names the variable it rejects.
A variable that is unset or empty reads as None.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import msgspec

from holdfast_contract.errors import EnvError

PREFIX = "HOLDFAST_"
DEFAULT_HEARTBEAT_MS = 50  # an engine's heartbeat period when the supervisor sets none


class EngineEnv(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str | None = None
    role: str | None = None  # primary | standby | batch
    port: int | None = None  # the engine's HTTP port
    host: str | None = None
    epoch: int | None = None  # fencing token; raised at each promotion
    model: str | None = None  # checkpoint dir (config and tokenizer)
    agent: str | None = None  # the supervisor's zmq ROUTER endpoint; unset: no agent
    daemons: tuple[str, ...] | None = None  # one cache daemon socket per rank, comma-separated
    rank: int | None = None
    world_size: int | None = None
    device: str | None = None
    heartbeat_ms: int | None = None
    run: str | None = None  # the supervisor's runtime dir
    dtype: str | None = None
    quantization: str | None = None
    kv_cache_mb: int | None = None
    model_impl: str | None = None
    dist_init: str | None = None
    verify: str | None = None  # stat | content: how an engine checks its pool's checkpoint
    # the keeper's socket: the engine keeps its KV cache there, shared, with a ledger of its
    # streams, for the standby promoted after its death (engine/kvshare.py)
    kv_share: str | None = None


FIELDS: tuple[str, ...] = EngineEnv.__struct_fields__
# the smallest and largest value each integer variable may hold
_BOUNDS: dict[str, tuple[int, int | None]] = {
    "port": (1, 65535),
    "epoch": (0, None),
    "rank": (0, None),
    "world_size": (1, None),
    "heartbeat_ms": (1, None),
    "kv_cache_mb": (1, None),
}


def var(field: str) -> str:
    """The variable that carries `field` of EngineEnv (`var("port") == "HOLDFAST_PORT"`)."""
    if field not in FIELDS:
        raise KeyError(f"{field!r} is not a field of EngineEnv; known: {', '.join(FIELDS)}")
    return PREFIX + field.upper()


def _parse_int(field: str, raw: str) -> int:
    name = var(field)
    try:
        value = int(raw)
    except ValueError:
        raise EnvError(f"{name}={raw!r} is not a valid int; set {name} to a whole number") from None
    low, high = _BOUNDS[field]
    if value < low or (high is not None and value > high):
        span = f"{low}..{high}" if high is not None else f"at least {low}"
        raise EnvError(f"{name}={raw!r} is out of range; set {name} to {span}")
    return value


def read_env(environ: Mapping[str, str] | None = None) -> EngineEnv:
    """Every HOLDFAST_* variable in `environ` (default: os.environ), parsed and checked.
    Raises EnvError naming the first variable that does not parse or is out of range."""
    environ = os.environ if environ is None else environ
    values: dict[str, object] = {}
    for field in FIELDS:
        raw = environ.get(var(field), "")
        if raw == "":
            continue
        if field in _BOUNDS:
            values[field] = _parse_int(field, raw)
        elif field == "daemons":
            values[field] = tuple(s for s in raw.split(",") if s)
        else:
            values[field] = raw
    return EngineEnv(**values)  # type: ignore[arg-type]


def to_environ(env: EngineEnv) -> dict[str, str]:
    """The variables for `env`: one per field that is set."""
    out: dict[str, str] = {}
    for field in FIELDS:
        value = getattr(env, field)
        if value is None:
            continue
        out[var(field)] = ",".join(value) if isinstance(value, tuple) else str(value)
    return out
