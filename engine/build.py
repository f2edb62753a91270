"""Building an engine's model: the CUDA context (and the process group), the model on the
meta device, its weights, the KV cache and the warm-up; each timed as a start-up phase.
An engine runs it at its start (engine.app), a ready spare before it is asked
(engine.ready).
"""

from __future__ import annotations

import gc
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import structlog
import torch
import torch.distributed as dist

from engine import api
from engine.config import EngineConfig, dist_init_method
from engine.metrics import Phases
from engine.server import Model

if TYPE_CHECKING:
    from engine.kvshare import Home

log = structlog.get_logger("engine")
FOLLOW_TIMEOUT = timedelta(days=365)  # followers wait on rank 0 for as long as it lives


class Clock:
    def __init__(self, t0: float) -> None:
        self.t0, self.last = t0, t0

    def lap(self) -> float:
        now = time.perf_counter()
        ms, self.last = (now - self.last) * 1e3, now
        return round(ms, 1)

    def total(self) -> float:
        return round((time.perf_counter() - self.t0) * 1e3, 1)


def context_init(cfg: EngineConfig) -> torch.device:
    device = torch.device(cfg.device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.zeros(1, device=device)  # create the CUDA context now, inside this phase
    if cfg.world_size > 1:
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            init_method=dist_init_method(cfg),
            rank=cfg.rank,
            world_size=cfg.world_size,
            timeout=FOLLOW_TIMEOUT,
        )
    return device


def build_llama(
    cfg: EngineConfig, device: torch.device, clock: Clock, phases: Phases
) -> tuple[Model, api.Limits, str]:
    from engine.batcher import BatchEngine
    from engine.kvcache import BlockAllocator, KVCache
    from engine.kvshare import STANDBY_TOKENS
    from engine.model import LlamaForCausalLM, TPGroup
    from engine.modelargs import check_tp, read_model_args
    from engine.runner import Runner
    from engine.scheduler import Scheduler
    from engine.weights import load_weights

    args = read_model_args(cfg.model)
    check_tp(args, cfg.world_size)
    tp = TPGroup(cfg.rank, cfg.world_size)
    module = LlamaForCausalLM(
        args, tp, getattr(torch, cfg.dtype), fp8=cfg.quantization == "fp8-block", device=str(device)
    )
    phases.build = clock.lap()
    report = load_weights(module, cfg)
    fused = module.fuse_projections()
    if device.type == "cuda":
        from engine import gemv
        from engine.paged_decode import triton_ready

        gemv.enabled = cfg.matvec == "triton" and triton_ready()
    phases.attach = clock.lap()
    log.info(
        "weights",
        source=report.source,
        ms=round(report.ms, 1),
        tensors=report.tensors,
        bytes=report.bytes,
        socket=report.socket,
        fused_groups=fused,
    )
    max_len = cfg.max_model_len or args.max_position_embeddings
    kv = args.num_key_value_heads // cfg.world_size
    dtype = getattr(torch, cfg.dtype)
    home = kv_home(cfg, args, device, max_len)
    shared = None
    if home is None:
        cache = KVCache(args.num_hidden_layers, kv, args.head_dim, cfg.kv_cache_mb, dtype, device)
    elif cfg.role == "standby":  # a small cache of its own until it is promoted
        home.withdraw()
        cache = home.standby_cache(STANDBY_TOKENS)
    else:
        shared = home.fresh(primary=cfg.role == "primary")
        cache = home.cache(shared)
    runner = Runner(
        module, device, cache, max_batch=cfg.max_batch, max_len=max_len, cuda_graphs=cfg.cuda_graphs
    )
    runner.warmup()  # CUDA graphs are captured after ready, between steps (engine.graphs)
    gc.freeze()  # start-up's objects leave the collector: a full collection, which holds
    # the GIL and so the heartbeat thread, then walks only what serving has made
    phases.warmup = clock.lap()
    log.info(
        "kv cache",
        blocks=cache.usable,
        block_size=cache.block_size,
        tokens=cache.tokens,
        mb=cache.bytes >> 20,
        max_batch=cfg.max_batch,
        cuda_graphs=runner.graphs is not None,
    )
    scheduler = Scheduler(
        BlockAllocator(cache.usable),
        runner.eos,
        block_size=cache.block_size,
        max_running=cfg.max_batch,
        max_waiting=cfg.max_waiting,
        prefill_tokens=cfg.prefill_tokens,
    )
    engine = BatchEngine(runner, scheduler)
    engine.home, engine.shared = home, shared
    return engine, api.Limits(args.vocab_size, max_len, cfg.max_tokens_cap), report.source


def kv_home(cfg: EngineConfig, args: Any, device: torch.device, max_len: int) -> Home | None:
    """Where the engine's KV cache is shared (`--kv-share`), or None: not asked, or not
    possible here (logged)."""
    from engine.kvcache import BLOCK_SIZE, blocks_in
    from engine.kvshare import Home, Layout, supported

    if not cfg.kv_share:
        return None
    why = supported(device, cfg.world_size)
    if why:
        log.warning("kv cache not shared", why=why)
        return None
    kv = args.num_key_value_heads // cfg.world_size
    dtype = getattr(torch, cfg.dtype)
    layout = Layout(
        layers=args.num_hidden_layers,
        blocks=blocks_in(
            cfg.kv_cache_mb, args.num_hidden_layers, kv, args.head_dim, dtype, BLOCK_SIZE
        ),
        block_size=BLOCK_SIZE,
        kv_heads=kv,
        head_dim=args.head_dim,
        dtype=cfg.dtype,
        model=f"{cfg.model} {cfg.dtype} {cfg.quantization}",
    )
    return Home(cfg.kv_share, cfg.name, layout, cfg.kv_cache_mb, cfg.max_batch, max_len, device)


def build_hf(
    cfg: EngineConfig, device: torch.device, clock: Clock, phases: Phases
) -> tuple[Model, api.Limits, str]:
    import transformers  # noqa: F401  (timed as an import, not as building the model)

    from engine.hf import HFModel
    from engine.serial import SerialEngine
    from engine.weights import load_weights

    phases.imports += clock.lap()
    model = HFModel(cfg.model, getattr(torch, cfg.dtype), device)
    phases.build = clock.lap()
    report = load_weights(model.module, cfg)
    phases.attach = clock.lap()
    log.info("weights", source=report.source, ms=round(report.ms, 1), tensors=report.tensors)
    model.finish()
    model.warmup()
    phases.warmup = clock.lap()
    max_len = min(cfg.max_model_len or model.max_len, model.max_len)
    return (
        SerialEngine(model, cfg.max_waiting),
        api.Limits(model.vocab_size, max_len, cfg.max_tokens_cap),
        report.source,
    )
