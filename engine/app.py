"""One engine process from start to exit: context, model, weights, warm-up (engine.build;
or what a ready spare built before it was asked: engine.ready), serve, drain.

Startup is timed in phases (imports, context init, build, attach, warm-up) from the first
line of `python -m engine`; the "ready" log line and /metrics carry them.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable
from pathlib import Path

import msgspec
import structlog
import torch.distributed as dist
from aiohttp import web

from engine import ready
from engine.agent_client import AgentClient
from engine.build import Clock, build_hf, build_llama, context_init
from engine.config import EngineConfig, dist_init_method
from engine.metrics import Metrics, Phases
from engine.peerwatch import PeerWatch, store_address
from engine.server import EngineServer, Model
from engine.tokenizer import load_tokenizer, read_before
from holdfast_contract import agent_protocol as wire

log = structlog.get_logger("engine")


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
        built = ready.take(cfg) if spare_ms else None  # a ready spare's (engine.ready)
        if built is not None:
            model, limits, source, tokenizer = (
                built.model,
                built.limits,
                built.source,
                built.tokenizer,
            )
        else:
            device = context_init(cfg)
            watch = watch_peers(cfg)
            phases.context_init = clock.lap()
            build = build_hf if cfg.model_impl == "hf" else build_llama
            model, limits, source = build(cfg, device, clock, phases)
            if cfg.rank > 0:
                log.info("following rank 0", rank=cfg.rank, startup_ms=clock.total())
                return follow(model, watch)
            tokenizer = load_tokenizer(cfg.model)
            took = clock.lap()
            phases.tokenizer = 0.0 if read_before(tokenizer) else took
        metrics = Metrics()
        metrics.phases, metrics.weights_source = phases, source
        server = EngineServer(
            cfg.name,
            cfg.role,
            cfg.epoch,
            model,
            tokenizer,
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


def _tokenizer_source(server: EngineServer) -> str:
    if server.tokenizer is None:
        return "none"
    return "read before the fork" if read_before(server.tokenizer) else "read"


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
    cfg: EngineConfig,
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

    refits: set[asyncio.Task[None]] = set()

    async def refit_now(cmd: wire.Refit) -> None:
        from engine.refit import refit  # torch's side: imported when first asked

        agent.refitted(await refit(server, cfg, cmd))

    def start_refit(cmd: wire.Refit) -> None:
        def start() -> None:
            task = loop.create_task(refit_now(cmd))
            refits.add(task)
            task.add_done_callback(refits.discard)

        loop.call_soon_threadsafe(start)

    take_cache = getattr(server.model, "promoted_cache", None)
    if take_cache is not None:
        agent.on_adopt(take_cache)
    agent.on_promote(promote)
    agent.on_drain(drain)
    agent.on_stop(stop)
    agent.on_refit(start_refit)


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
        wire_agent(agent, cfg, server, loop, request_stop, cfg.grace_s)
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
        # the tokenizer's files: read here, read by the fork server before the fork, none
        tokenizer=_tokenizer_source(server),
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
