"""Engine kinds (`engines.kind`), registered in one place: `KINDS`.

An engine kind is three things: its start command (`resolve` writes its argv template,
environment and health into the policy; `engines.EngineLauncher` renders them per rank
into a `watcher.Command`), its readiness probe and its health probe. Readiness and health
come from `engines.health` (`HEALTH`): `agent`, the agent's Hello and ready state and its
heartbeats, which arrive on the agents socket (`agent_hub`, `core.Cluster.on_hello`), so
no task probes them; `http`, `GET /health` at the heartbeat interval, whose first 200 makes
the engine ready and each 200 is a heartbeat (`http_health`). A kind may add probes of its
own (vLLM's load from `/metrics`). The launcher runs them all, as tasks of its `Watcher`,
for as long as the incarnation lives. What a silence or a missed deadline means is judged
in `decisions.liveness`, not here.

A new kind: a `Kind` with its `resolve`, `errors` and `probes`, added to `KINDS` and to
`EnginesSpec.kind` (supervisor/policy.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp

from supervisor import vllm_kind

if TYPE_CHECKING:
    from supervisor.policy import Policy
    from supervisor.units import Engine, Incarnation

BeatFn = Callable[["Engine", "Incarnation"], None]
# a probe: runs while the incarnation lives; reports a 200 (ready, alive) through BeatFn
Probe = Callable[["Engine", "Incarnation", "Policy", BeatFn], Coroutine[Any, Any, None]]


async def http_health(e: Engine, inc: Incarnation, p: Policy, on_beat: BeatFn) -> None:
    """Heartbeats for engines without the agent: GET /health on their port."""
    interval = p.heartbeat.interval_ms / 1000.0
    timeout = aiohttp.ClientTimeout(total=max(interval, 0.5))
    async with aiohttp.ClientSession(timeout=timeout) as http:
        while not inc.handled and e.inc is inc:
            try:
                async with http.get(f"http://127.0.0.1:{e.port}/health") as r:
                    if r.status == 200:
                        on_beat(e, inc)
            except (aiohttp.ClientError, OSError, TimeoutError):
                pass
            await asyncio.sleep(interval)


async def vllm_load(e: Engine, inc: Incarnation, p: Policy, on_beat: BeatFn) -> None:
    """vLLM's load for the batch rules, from its /metrics (`vllm_kind.watch_load`)."""
    await vllm_kind.watch_load(e, inc, p)


# readiness and health probes per `engines.health`; "agent": the agents socket brings both
HEALTH: dict[str, tuple[Probe, ...]] = {"agent": (), "http": (http_health,)}


def _as_given(p: Policy) -> Policy:
    return p


def _no_errors(p: Policy, *, schema_only: bool) -> list[str]:
    return []


@dataclass(frozen=True)
class Kind:
    name: str
    # `p` with this kind's start command (engines.command, env, health) filled in
    resolve: Callable[[Policy], Policy] = _as_given
    errors: Callable[..., list[str]] = _no_errors  # (p, *, schema_only) -> what to change
    probes: tuple[Probe, ...] = ()  # beyond readiness and health (`HEALTH`)


KINDS: dict[str, Kind] = {
    k.name: k
    for k in (
        Kind("holdfast"),  # engines.command as given; the agent, or engines.health: http
        Kind("vllm", vllm_kind.resolve, vllm_kind.errors, (vllm_load,)),
    )
}


def kind_of(p: Policy) -> Kind:
    return KINDS[p.engines.kind]  # `EnginesSpec.kind` allows only these names


def probes(p: Policy) -> tuple[Probe, ...]:
    """What the launcher runs for each incarnation of `p`'s engines: readiness and health
    (`HEALTH[engines.health]`), then the kind's own."""
    return HEALTH[p.engines.health] + kind_of(p).probes
