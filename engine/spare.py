"""A spare engine process: a fork that has made its CUDA context and loaded the step's
kernels before any engine asked for it.

An engine forked from the fork server still pays, after the fork, for its CUDA context
(0.16-0.19 s on an H200) and for the first launch of every kernel its first step runs
(cuBLAS, flash attention, the sampler's, Triton's from its disk cache: 0.4-0.6 s). Neither
needs the engine's weights, only the device, the environment CUDA starts in, and tensors
of the model's shapes. So after forking an engine the fork server forks a spare from the
same request: it makes the context and runs the runner's warm-up on a one-layer model of
the same shapes with zeroed weights (and a KV cache with as many blocks as the engine's),
frees that memory, and waits. The next request with the same `key` is handed to the spare,
which then starts like any fork: it attaches the real weights and warms up again, finding
its kernels loaded. What the spare keeps while it waits: its CUDA context (about 0.5 GB of
device memory) and nothing else.

Only an engine of one rank with the reference model gets a spare: a tensor-parallel rank's
process group is made per engine, and `--model-impl hf` warms up through transformers.
"""

from __future__ import annotations

import contextlib
import gc
import io
import math
import time
from pathlib import Path

import msgspec
import structlog

from engine.config import EngineConfig, from_args
from engine.errors import EngineError
from holdfast_contract.forkserver import Spawn

log = structlog.get_logger("engine.spare")
# auto: spares for CUDA devices only; on: on any device; ready: on any device, each
# building the whole engine ahead (engine.ready); off: none
MODES = ("auto", "on", "ready", "off")


def config(spawn: Spawn) -> EngineConfig | None:
    """The engine config `spawn` asks for, or None if its flags or environment are bad
    (the engine forked for it reports why)."""
    with contextlib.redirect_stderr(io.StringIO()):  # argparse's usage text: the engine's
        try:
            return from_args(spawn.argv, spawn.env)
        except (EngineError, msgspec.MsgspecError, SystemExit):
            return None


def key(spawn: Spawn, mode: str) -> tuple[str, ...] | None:
    """What a spare made from `spawn` depends on; a request with the same key may take it.
    None: no spare for this request (see the module's doc, and `mode`)."""
    cfg = config(spawn) if mode != "off" else None
    if cfg is None or cfg.world_size != 1 or cfg.model_impl != "llama":
        return None
    if mode == "auto" and not cfg.device.startswith("cuda"):
        return None
    if mode == "ready":  # built for one request's settings: only the same ones may take it
        from engine.ready import settings

        env = sorted((k, v) for k, v in spawn.env.items() if not k.startswith("HOLDFAST_"))
        return (cfg.device, repr(settings(cfg)), repr(env))
    # every variable but the engine's own settings may change how CUDA starts
    env = sorted((k, v) for k, v in spawn.env.items() if not k.startswith("HOLDFAST_"))
    # the model's shapes, not its dir: the next version of a model (an update's checkpoint
    # of the same shapes) takes the spare the last version's engine left
    try:
        model = (Path(cfg.model) / "config.json").read_text()
    except (OSError, UnicodeDecodeError):
        return None
    shapes = (model, cfg.dtype, cfg.quantization, cfg.max_batch, cfg.max_model_len)
    return (cfg.device, *map(str, shapes), str(cfg.kv_cache_mb), repr(env))


def warm(spawn: Spawn, mode: str = "auto") -> dict[str, float]:
    """In the spare, before it is claimed: the context and the kernels (with mode "ready",
    the whole engine: engine.ready); ms by phase."""
    import torch

    from engine.build import context_init
    from engine.kvcache import KVCache
    from engine.model import LlamaForCausalLM, TPGroup
    from engine.modelargs import read_model_args
    from engine.runner import Runner

    t0 = last = time.perf_counter()
    phases: dict[str, float] = {}

    def lap(name: str) -> None:
        nonlocal last
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        phases[name], last = round((now - last) * 1e3, 1), now

    cfg = config(spawn)
    if cfg is None:
        raise EngineError("the request a spare was made from does not parse")
    if mode == "ready":
        from engine import ready

        return ready.build(cfg)
    device = context_init(cfg)
    lap("context_init")
    args = read_model_args(cfg.model)
    layers = args.num_hidden_layers
    one = msgspec.structs.replace(args, num_hidden_layers=1)
    dtype = getattr(torch, cfg.dtype)
    model = LlamaForCausalLM(
        one, TPGroup(), dtype, fp8=cfg.quantization == "fp8-block", device=str(device)
    )
    model.to_empty(device=device)
    with torch.no_grad():
        for t in (*model.parameters(), *model.buffers()):
            t.zero_()
    # one layer of the engine's budget holds as many blocks as the engine's whole cache
    kv = KVCache(
        1,
        args.num_key_value_heads,
        args.head_dim,
        math.ceil(cfg.kv_cache_mb / layers),
        dtype,
        device,
    )
    lap("build")
    max_len = cfg.max_model_len or args.max_position_embeddings
    Runner(model, device, kv, max_batch=cfg.max_batch, max_len=max_len, cuda_graphs=False).warmup()
    lap("warmup")
    del model, kv
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the shadow's memory back: the spare keeps its context only
    lap("free")
    phases["total"] = round((time.perf_counter() - t0) * 1e3, 1)
    return phases
