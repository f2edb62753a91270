"""A ready spare (`--spares ready`): a spare that has built the whole engine before any
request asked for it, so that a claim only starts serving.

A spare made by `--spares on` keeps its CUDA context and its loaded kernels, then attaches
the weights and warms up again once claimed (engine.spare). A ready spare goes on from
there: it runs the engine's own build (`engine.build.build_llama`) for the request it was
made from: the model attached to the pool (or read from disk, as the request says), the
KV cache allocated, the warm-up run against the real weights and cache, every CUDA graph
captured; and it loads the tokenizer. What is left after the claim is what depends on
which engine it becomes: its name, role, epoch and port, its agent, its HTTP server.

It is taken (`take`) only by a request whose settings, all but those, equal the ones it
was built for, and only while the checkpoint's files are the ones it was built from (their
stat facts, as the daemon compares them; a changed checkpoint is never served as the old
one). Otherwise it is dropped and the engine builds as a fresh fork does. Its cost while
it waits: a KV cache (`--kv-cache-mb`) and the graphs' memory beside the engines'.
"""

from __future__ import annotations

import gc
import time
from typing import Any, NamedTuple

import msgspec
import structlog

from engine.config import EngineConfig
from engine.errors import EngineError

log = structlog.get_logger("engine.ready")

# what a claim sets: everything else must equal what the spare was built for
IDENTITY = (
    "name",
    "role",
    "port",
    "host",
    "epoch",
    "agent",
    "heartbeat_ms",
    "grace_s",
    "log_format",
)
_BLANK = EngineConfig(model="")


def settings(cfg: EngineConfig) -> EngineConfig:
    """`cfg` without the fields a claim sets (IDENTITY): what a ready spare depends on."""
    return msgspec.structs.replace(cfg, **{f: getattr(_BLANK, f) for f in IDENTITY})


def checkpoint_stamp(cfg: EngineConfig) -> Any:
    """The checkpoint as the daemon compares it, without reading tensor data: the
    CacheConfig of its pool, the files' stat facts included."""
    from cachedaemon.config import config_for
    from engine.weights import load_options

    return config_for(cfg.model, load_options(cfg))


class Ready(NamedTuple):
    settings: EngineConfig
    checkpoint: Any  # checkpoint_stamp when it was built (a CacheConfig)
    device: Any  # torch.device
    model: Any  # engine.server.Model
    limits: Any  # engine.api.Limits
    source: str  # where its weights came from: "daemon" | "disk"
    tokenizer: Any


_ready: Ready | None = None  # this process's, once built


def build(cfg: EngineConfig) -> dict[str, float]:
    """In the spare, before it is claimed: the whole engine for `cfg`; ms by phase."""
    global _ready
    from engine.batcher import BatchEngine
    from engine.build import Clock, build_llama, context_init
    from engine.metrics import Phases
    from engine.tokenizer import load_tokenizer

    clock, phases = Clock(time.perf_counter()), Phases()
    device = context_init(cfg)
    phases.context_init = clock.lap()
    model, limits, source = build_llama(cfg, device, clock, phases)
    if not isinstance(model, BatchEngine):
        raise EngineError(f"a ready spare builds the reference model, not {type(model).__name__}")
    graphs = 0
    while model.runner.capture_next():  # against the real weights' and cache's addresses
        graphs += 1
    tokenizer = load_tokenizer(cfg.model)
    tail = clock.lap()
    _ready = Ready(settings(cfg), checkpoint_stamp(cfg), device, model, limits, source, tokenizer)
    log.info("spare built", source=source, graphs=graphs)
    return {
        "context_init": phases.context_init,
        "build": phases.build,
        "attach": phases.attach,
        "warmup": phases.warmup,
        "graphs_and_tokenizer": tail,
        "total": clock.total(),
    }


def take(cfg: EngineConfig) -> Ready | None:
    """In the claimed engine: what its spare built, if that is what `cfg` asks for (see the
    module's doc); None, with what it held freed, if not or if there is none."""
    global _ready
    ready, _ready = _ready, None
    if ready is None:
        return None
    why = ""
    if ready.settings != settings(cfg):
        changed = [
            f
            for f in ready.settings.__struct_fields__
            if getattr(ready.settings, f) != getattr(settings(cfg), f)
        ]
        why = f"settings differ: {', '.join(changed)}"
    elif changed := ready.checkpoint.diff(checkpoint_stamp(cfg)):
        why = (
            f"the checkpoint's files changed since the spare was built ({cfg.model}: "
            f"{', '.join(changed)})"
        )
    if not why:
        return ready
    log.warning("spare's build not used", reason=why)
    device = ready.device
    del ready
    free(device)
    return None


def free(device: Any) -> None:
    """Collect what a dropped build held (its KV cache, graphs and weight mappings).
    build_llama froze start-up's objects out of the collector's reach: thaw them first
    (the build that follows freezes its own)."""
    import torch

    gc.unfreeze()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
