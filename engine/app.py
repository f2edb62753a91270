"""One engine process from start to exit: context, model, weights, warm-up, serve, drain.

Startup is timed in phases (imports, context init, build, attach, warm-up) from the first
line of `python -m engine`; the "ready" log line and /metrics carry them.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import msgspec
import structlog
import torch
import torch.distributed as dist
from aiohttp import web

from engine import api
from engine.agent_client import AgentClient
from engine.config import EngineConfig, dist_init_method
from engine.metrics import Metrics, Phases
from engine.peerwatch import PeerWatch, store_address
from engine.server import EngineServer, Model
from engine.tokenizer import load_tokenizer

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


def watch_peers(cfg: EngineConfig) -> PeerWatch | None:
    """A tensor-parallel rank exits 3 when a peer dies or stops, instead of hanging."""
    if cfg.world_size == 1:
        return None
    address = store_address(dist_init_method(cfg), os.environ)
    if address is None:
        log.warning(
            "no peer watch: it needs a tcp:// or env:// rendezvous", dist_init=cfg.dist_init
        )
        return None
    watch = PeerWatch(address, cfg.rank, cfg.world_size, stale_s=cfg.peer_stale_s)
    watch.start()
    return watch


def build_llama(
    cfg: EngineConfig, device: torch.device, clock: Clock, phases: Phases
) -> tuple[Model, api.Limits, str]:
    from engine.batcher import BatchEngine
    from engine.kvcache import BlockAllocator, KVCache
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
    phases.attach = clock.lap()
    log.info(
        "weights",
        source=report.source,
        ms=round(report.ms, 1),
        tensors=report.tensors,
        bytes=report.bytes,
        socket=report.socket,
    )
    max_len = cfg.max_model_len or args.max_position_embeddings
    kv = args.num_key_value_heads // cfg.world_size
    dtype = getattr(torch, cfg.dtype)
    cache = KVCache(args.num_hidden_layers, kv, args.head_dim, cfg.kv_cache_mb, dtype, device)
    runner = Runner(
        module, device, cache, max_batch=cfg.max_batch, max_len=max_len, cuda_graphs=cfg.cuda_graphs
    )
    runner.warmup()  # CUDA graphs are captured after ready, between steps (engine.graphs)
    gc.freeze()  # start-up's objects leave the collector: a full collection, which holds
    # the GIL and so the heartbeat thread, then walks only what serving has made
    phases.warmup = clock.lap()
    log.info(
        "kv cache",
        blocks=cache.blocks,
        block_size=cache.block_size,
        tokens=cache.tokens,
        mb=cache.bytes >> 20,
        max_batch=cfg.max_batch,
        cuda_graphs=runner.graphs is not None,
    )
    scheduler = Scheduler(
        BlockAllocator(cache.blocks),
        runner.eos,
        block_size=cache.block_size,
        max_running=cfg.max_batch,
        max_waiting=cfg.max_waiting,
        prefill_tokens=cfg.prefill_tokens,
    )
    engine = BatchEngine(runner, scheduler)
    return engine, api.Limits(args.vocab_size, max_len, cfg.max_tokens_cap), report.source


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


class Load:
    """What heartbeats report: (in flight, queued) of the server, once there is one."""

    def __init__(self) -> None:
        self.server: EngineServer | None = None

    def __call__(self) -> tuple[int, int]:
        s = self.server
        return (s.in_flight, s.queued) if s is not None else (0, 0)


def run(cfg: EngineConfig, t0: float, spare_ms: float = 0.0) -> int:
    clock, phases, load = Clock(t0), Phases(spare=round(spare_ms, 1)), Load()
    phases.imports = clock.lap()
    agent = start_agent(cfg, load) if cfg.rank == 0 and cfg.agent else None
    watch: PeerWatch | None = None
    try:
        device = context_init(cfg)
        watch = watch_peers(cfg)
        phases.context_init = clock.lap()
        build = build_hf if cfg.model_impl == "hf" else build_llama
        model, limits, source = build(cfg, device, clock, phases)
        if cfg.rank > 0:
            log.info("following rank 0", rank=cfg.rank, startup_ms=clock.total())
            return follow(model, watch)
        metrics = Metrics()
        metrics.phases, metrics.weights_source = phases, source
        server = EngineServer(
            cfg.name,
            cfg.role,
            cfg.epoch,
            model,
            load_tokenizer(cfg.model),
            limits,
            metrics,
            model_id=Path(cfg.model).name,
        )
        load.server = server
        return asyncio.run(serve(cfg, server, agent, watch, clock))
    finally:
        if watch is not None:
            watch.close()
        if agent is not None:
            agent.close()


def follow(model: Model, watch: PeerWatch | None) -> int:
    """Ranks > 0: follow rank 0 until it says stop (0) or is gone (3).

    The process group is torn down here, not in interpreter teardown, where gloo's threads
    abort the process about half the time. NCCL's teardown waits for rank 0's, so the stop
    mark that rank 0 waits for comes first.
    """
    status = model.follow()
    if status != 0:
        os._exit(status)
    if watch is not None:
        watch.stop()
    dist.destroy_process_group()
    return 0


def stop_group(model: Model, watch: PeerWatch | None) -> None:
    """Rank 0: disarm the watch, stop the followers, keep the store up until they are done."""
    if watch is not None:
        watch.stop()
    model.stop_followers()
    if watch is not None:
        watch.wait_stopped()
    if dist.is_initialized():
        dist.destroy_process_group()


def start_agent(cfg: EngineConfig, load: Load) -> AgentClient:
    agent = AgentClient(
        cfg.agent,
        name=cfg.name,
        role=cfg.role,
        port=cfg.port,
        epoch=cfg.epoch,
        interval_s=cfg.heartbeat_ms / 1000.0,
        load=load,
    )
    agent.start()
    return agent


def wire_agent(
    agent: AgentClient,
    server: EngineServer,
    loop: asyncio.AbstractEventLoop,
    request_stop: Callable[[float], None],
    grace_s: float,
) -> None:
    """Agent commands arrive on the agent's thread; each hops onto the event loop."""

    def promote(epoch: int) -> None:
        loop.call_soon_threadsafe(server.promote, epoch)

    def drain(grace: float) -> None:
        loop.call_soon_threadsafe(request_stop, grace)

    def stop() -> None:
        loop.call_soon_threadsafe(request_stop, grace_s)

    agent.on_promote(promote)
    agent.on_drain(drain)
    agent.on_stop(stop)


async def serve(
    cfg: EngineConfig,
    server: EngineServer,
    agent: AgentClient | None,
    watch: PeerWatch | None,
    clock: Clock,
) -> int:
    loop = asyncio.get_running_loop()
    stop: asyncio.Future[float] = loop.create_future()

    def request_stop(grace_s: float) -> None:
        if not stop.done():
            stop.set_result(grace_s)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, request_stop, cfg.grace_s)
    server.bind(loop)
    server.model.start()
    if agent is not None:
        server.on_state = agent.set_state
        wire_agent(agent, server, loop, request_stop, cfg.grace_s)
    # handler_cancellation: a client that hangs up cancels its handler, and so its generation
    runner = web.AppRunner(
        server.app(), handle_signals=False, access_log=None, handler_cancellation=True
    )
    await runner.setup()
    await web.TCPSite(runner, cfg.host, cfg.port).start()
    server.metrics.phases.total = clock.total()
    server.ready()
    log.info(
        "ready",
        engine=cfg.name,
        role=cfg.role,
        port=cfg.port,
        weights=server.metrics.weights_source,
        phases=msgspec.structs.asdict(server.metrics.phases),
    )
    grace = await stop
    finished = await server.drain(grace)
    await runner.cleanup()
    if finished:
        await server.call_model(stop_group, server.model, watch)
    log.info("stopped", engine=cfg.name, clean=finished)
    if not finished:
        os._exit(0)  # the model thread is still busy past the grace: leave without it
    return 0
