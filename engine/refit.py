"""A refit in place: the engine serves another pool's weights (same names, shapes and
layout) without a restart, when the supervisor's Refit says so.

It takes no new requests (503, which the router retries elsewhere; or, told to `hold`
them, as a primary that no standby replaced is, they wait and are served by the new
weights), lets those in flight finish within the command's grace (an answer is never
made by two versions; told to `cut` them, as a refit with update.refit_inflight: retry
tells a superseded primary, it closes their connections at once and the router answers
them from the new weights), then, at a
step boundary on the model thread, maps the new pool over the old one
(`cachedaemon.refit`): every pointer stays, so the CUDA graphs captured over the weights
replay the new ones. Prefixes kept warm are given back. Past the grace nothing is swapped:
the engine serves on as before and says why not; the supervisor then restarts it on the
new pool instead."""

from __future__ import annotations

import asyncio
import os
import time

import structlog

from cachedaemon import refit as pool_refit
from cachedaemon.config import config_for
from cachedaemon.errors import CacheError
from engine.batcher import BatchEngine
from engine.config import EngineConfig
from engine.server import EngineServer
from engine.weights import load_options
from holdfast_contract import agent_protocol as wire

log = structlog.get_logger("engine.refit")


async def refit(server: EngineServer, cfg: EngineConfig, cmd: wire.Refit) -> wire.Refitted:
    """Carry out one Refit; what became of it, for the supervisor."""
    t0 = time.perf_counter()

    def answer(ok: bool, detail: str = "", swap_ms: float = 0.0) -> wire.Refitted:
        ms = round((time.perf_counter() - t0) * 1e3, 1)
        version = cmd.version if ok else server.version
        log.info("refit", ok=ok, version=version, ms=ms, swap_ms=swap_ms, detail=detail)
        return wire.Refitted(server.name, version, ok, detail, ms, swap_ms)

    model = server.model
    if not isinstance(model, BatchEngine) or cfg.world_size > 1:
        return answer(False, "only a one-rank reference Llama engine refits in place")
    if server.state in ("draining", "refitting", "starting"):
        return answer(False, f"the engine is {server.state}")
    if cmd.cut:
        # update.refit_inflight: retry: the router answers them from the new weights (the
        # new primary serves them already), so they are cut at once, not after the new
        # pool is mapped here: each token made meanwhile would be one more to compute again
        server.set_state("refitting")
        server.cut()
    try:
        pending = await asyncio.to_thread(
            pool_refit.fetch,
            cmd.socket,
            config_for(cmd.model, load_options(cfg)),
            model.tensors(),
            timeout=cfg.attach_timeout_s,
        )
    except CacheError as e:
        if server.state == "refitting":
            server.ready()
        return answer(False, str(e))
    if server.state != "refitting":
        server.set_state("refitting")
    if cmd.hold:
        server.holding = asyncio.Event()
    try:
        if not await server.idle(cmd.grace_s):
            pending.close()
            return answer(
                False,
                f"{server.in_flight} requests were still in flight after {cmd.grace_s} s",
            )
        await asyncio.wrap_future(model.between_steps(pending.swap))
        server.version = cmd.version
    except CacheError as e:  # the swap itself failed: what the device maps is unknown
        log.error("refit swap failed; the engine exits", error=str(e))
        os._exit(3)
    finally:
        pending.close()
        if server.state == "refitting":
            server.ready()
        if server.holding is not None:
            server.holding.set()
            server.holding = None
    return answer(True, swap_ms=round(pending.swap_ms, 3))
