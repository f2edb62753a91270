"""EngineConfig: every setting of one engine process, from HOLDFAST_* env or flags.

Defaults live here and only here. Flags win over the environment, so the supervisor's
environment works unchanged and a person can run one engine by hand.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Mapping, Sequence

import msgspec

from engine.errors import EngineError
from holdfast_contract.env import DEFAULT_HEARTBEAT_MS, read_env, var
from holdfast_contract.errors import EnvError
from holdfast_contract.formats import DTYPES, QUANTIZATIONS

ROLES = ("primary", "standby", "batch")
VERIFY = ("stat", "content")
IMPLS = ("llama", "hf")
MATVECS = ("cublas", "triton")

EXAMPLE = """example:
  cachedaemon make-checkpoint /tmp/models/tiny --preset tiny
  cachedaemon serve --model /tmp/models/tiny --device cpu --runtime-dir /tmp/run &
  python -m engine --model /tmp/models/tiny --daemons /tmp/run/daemon-0.sock --port 8100
  curl -s localhost:8100/v1/completions -d '{"prompt_token_ids": [1, 2, 3], "max_tokens": 8}'
"""


class EngineConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model: str
    name: str = "engine"
    role: str = "primary"
    port: int = 8000
    host: str = "127.0.0.1"
    epoch: int = 0
    agent: str = ""
    daemons: tuple[str, ...] = ()
    rank: int = 0
    world_size: int = 1
    dtype: str = "bfloat16"
    quantization: str = "none"
    device: str = "cpu"
    model_impl: str = "llama"
    allow_disk_fallback: bool = False
    # stat: attach a pool loaded from this --model's very files (no tensor data read);
    # content: also one whose files hold the same bytes (a copy), after digesting them
    verify: str = "stat"
    dist_init: str = ""
    max_tokens_cap: int = 1024
    max_model_len: int = 0  # 0: the checkpoint's max_position_embeddings
    kv_cache_mb: int = 1024  # the KV cache, preallocated at start
    heartbeat_ms: int = DEFAULT_HEARTBEAT_MS  # the agent's heartbeat period
    max_batch: int = 128  # most requests one step runs
    max_waiting: int = 256  # requests queued for KV space beyond the batch; then 503
    prefill_tokens: int = 8192  # prompt tokens one prefill step takes (a longer one alone)
    threads: int = 0  # torch's intra-op threads on the CPU; 0: torch's default (one a core)
    cuda_graphs: bool = True
    # one-row products on CUDA (a one-request decode step): cuBLAS, or holdfast's Triton
    # kernel (engine/gemv.py)
    matvec: str = "triton"
    grace_s: float = 30.0
    attach_timeout_s: float = 10.0
    peer_stale_s: float = 5.0  # tensor parallel: a peer silent this long means exit 3
    log_format: str = "auto"  # console on a terminal, JSON lines otherwise
    kv_share: str = ""  # the keeper's socket: the KV cache is shared there (engine.kvshare)

    @property
    def socket(self) -> str:
        """This rank's daemon socket, or "" to load from disk."""
        return self.daemons[self.rank] if self.daemons else ""


_DEFAULTS = EngineConfig(model="")

# settings with a flag and a HOLDFAST_* variable (holdfast_contract.env); the flag's dest
# is the EngineConfig field, the variable the contract's name for it
_ENV_FIELDS = (
    "model",
    "name",
    "role",
    "port",
    "host",
    "epoch",
    "agent",
    "daemons",
    "rank",
    "world_size",
    "dtype",
    "quantization",
    "device",
    "model_impl",
    "dist_init",
    "verify",
    "kv_cache_mb",
    "heartbeat_ms",
    "kv_share",  # the keeper's socket: the KV cache is shared there (engine/kvshare.py)
)


def _flag_type(field: str) -> type:
    default = getattr(_DEFAULTS, field)
    return str if isinstance(default, tuple) else type(default)


# flag-only settings: field -> (type, help); the flag is --field-with-dashes
_FLAGS: dict[str, tuple[type, str]] = {
    "max_tokens_cap": (int, "largest max_tokens a request may ask for"),
    "max_model_len": (int, "context length (prompt + generated); 0 = the checkpoint's"),
    "max_batch": (int, "most requests decoded together in one step"),
    "max_waiting": (int, "requests that may wait for KV space; past it the engine answers 503"),
    "prefill_tokens": (int, "prompt tokens one step prefills (a longer prompt runs alone)"),
    "threads": (
        int,
        "torch's intra-op threads (CPU ops); 0 = torch's default, one per core; engines "
        "sharing few cores run best at 1",
    ),
    "matvec": (
        str,
        "one-row products on CUDA (a one-request decode step): cublas, or triton "
        "(holdfast's kernel, engine/gemv.py)",
    ),
    "grace_s": (float, "on SIGTERM, seconds to let in-flight requests finish"),
    "attach_timeout_s": (float, "seconds to wait for each daemon socket"),
    "peer_stale_s": (
        float,
        "tensor parallel: exit 3 when a peer rank has been silent this many seconds",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m engine",
        description="holdfast reference engine: attach weights from the cache daemon(s), "
        "warm up, serve many requests at once (continuous batching over a paged KV cache) "
        "on /v1/completions, /v1/chat/completions, /v1/embeddings, /v1/models, /health and "
        "/metrics. Every flag also reads the HOLDFAST_* variable named in its help.",
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for field in _ENV_FIELDS:
        flag = "--" + field.replace("_", "-")
        default = getattr(_DEFAULTS, field)
        shown = ",".join(default) if isinstance(default, tuple) else default
        p.add_argument(
            flag,
            dest=field,
            type=_flag_type(field),
            default=None,
            help=f"env {var(field)}; default {shown!r}",
        )
    p.add_argument(
        "--allow-disk-fallback",
        action="store_true",
        help="load from the checkpoint dir when no daemon answers or it mismatches",
    )
    for field, (kind, help_) in _FLAGS.items():
        p.add_argument(
            "--" + field.replace("_", "-"),
            type=kind,
            default=getattr(_DEFAULTS, field),
            help=help_,
        )
    p.add_argument(
        "--no-cuda-graphs",
        dest="cuda_graphs",
        action="store_false",
        help="decode eagerly on CUDA (graphs are captured after ready by default)",
    )
    p.add_argument(
        "--log-format",
        choices=["auto", "console", "json"],
        default=_DEFAULTS.log_format,
        help="stderr log lines (auto: console on a tty)",
    )
    return p


def from_args(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> EngineConfig:
    """Flags first, then HOLDFAST_* env, then the defaults above; validated."""
    ns = build_parser().parse_args(argv)
    try:
        from_env = read_env(env)
    except EnvError as e:
        raise EngineError(str(e)) from e
    values: dict[str, object] = {}
    for field in _ENV_FIELDS:
        raw = getattr(ns, field)
        raw = getattr(from_env, field) if raw is None else raw
        if raw is not None:
            values[field] = raw
    if isinstance(values.get("daemons"), str):
        values["daemons"] = tuple(s for s in str(values["daemons"]).split(",") if s)
    for field in ("allow_disk_fallback", "log_format", "cuda_graphs", *_FLAGS):
        values[field] = getattr(ns, field)
    if not values.get("model"):
        raise EngineError("no checkpoint dir: pass --model DIR or set HOLDFAST_MODEL")
    cfg = msgspec.convert(values, EngineConfig)
    validate(cfg)
    return cfg


def _choice(value: str, allowed: tuple[str, ...], flag: str) -> None:
    if value not in allowed:
        raise EngineError(f"{flag} {value!r} is not one of {', '.join(allowed)}")


def validate(cfg: EngineConfig) -> None:
    _choice(cfg.role, ROLES, "--role/HOLDFAST_ROLE")
    _choice(cfg.dtype, DTYPES, "--dtype/HOLDFAST_DTYPE")
    _choice(cfg.quantization, QUANTIZATIONS, "--quantization/HOLDFAST_QUANTIZATION")
    _choice(cfg.model_impl, IMPLS, "--model-impl/HOLDFAST_MODEL_IMPL")
    _choice(cfg.verify, VERIFY, "--verify/HOLDFAST_VERIFY")
    _choice(cfg.matvec, MATVECS, "--matvec")
    if not 0 < cfg.port < 65536:
        raise EngineError(f"--port/HOLDFAST_PORT {cfg.port} must be in 1..65535")
    if cfg.world_size < 1 or not 0 <= cfg.rank < cfg.world_size:
        raise EngineError(f"--rank {cfg.rank} must be in [0, --world-size {cfg.world_size})")
    if cfg.daemons and len(cfg.daemons) != cfg.world_size:
        raise EngineError(
            f"--daemons/HOLDFAST_DAEMONS names {len(cfg.daemons)} sockets; "
            f"give one per rank ({cfg.world_size}), comma-separated"
        )
    if cfg.model_impl == "hf" and cfg.world_size != 1:
        raise EngineError("--model-impl hf serves at --world-size 1 only")
    if not cfg.daemons and not cfg.allow_disk_fallback:
        raise EngineError(
            "no daemon socket: pass --daemons SOCK[,SOCK...] (HOLDFAST_DAEMONS) "
            "or --allow-disk-fallback to load from the checkpoint dir"
        )
    for flag, value in (
        ("--max-tokens-cap", cfg.max_tokens_cap),
        ("--kv-cache-mb/HOLDFAST_KV_CACHE_MB", cfg.kv_cache_mb),
        ("--heartbeat-ms/HOLDFAST_HEARTBEAT_MS", cfg.heartbeat_ms),
        ("--max-batch", cfg.max_batch),
        ("--max-waiting", cfg.max_waiting),
        ("--prefill-tokens", cfg.prefill_tokens),
    ):
        if value < 1:
            raise EngineError(f"{flag} must be at least 1 (got {value})")
    if cfg.threads < 0:
        raise EngineError(f"--threads must be 0 (torch's default) or more (got {cfg.threads})")
    if not (math.isfinite(cfg.peer_stale_s) and cfg.peer_stale_s >= 1):
        raise EngineError(
            f"--peer-stale-s must be a number of seconds, at least 1 (got {cfg.peer_stale_s:g})"
        )


def log_format(cfg: EngineConfig) -> str:
    if cfg.log_format != "auto":
        return cfg.log_format
    return "console" if sys.stderr.isatty() else "json"


def dist_init_method(cfg: EngineConfig) -> str:
    """Rendezvous for torch.distributed: --dist-init, else MASTER_ADDR/PORT, else by port."""
    if cfg.dist_init:
        return cfg.dist_init
    if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        return "env://"
    return f"tcp://127.0.0.1:{(cfg.port + 10007) % 55000 + 10000}"
