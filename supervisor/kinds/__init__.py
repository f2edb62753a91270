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

A kind may also have a fork server (`forks`): a process that has imported the engine's
code and forks each engine from it (engine.forkserver for the reference engine,
holdfast_vllm.forkserver for vLLM); an engine whose command it does not serve is exec'd.

A new kind: a `Kind` with its `resolve`, `errors`, `probes` and `forks`, added to `KINDS`
and to `EnginesSpec.kind` (supervisor/policy.py).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp

from holdfast_contract.command import FORKABLE, is_forkable
from supervisor import vllm_kind

if TYPE_CHECKING:
    from supervisor.policy import Policy
    from supervisor.units import Engine, Incarnation

BeatFn = Callable[["Engine", "Incarnation"], None]
# a probe: runs while the incarnation lives; reports a 200 (ready, alive) through BeatFn
Probe = Callable[["Engine", "Incarnation", "Policy", BeatFn], Coroutine[Any, Any, None]]
FORKABLE_ARGV = [arg.format(python=sys.executable) for arg in FORKABLE]  # what forks serve


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
class Forks:
    """A fork server for a kind: the command that runs it (`--socket PATH` is added), and
    the head of the engine commands it forks (the rest of each travels in the request)."""

    server: list[str]
    serves: list[str]
    name: str  # of its socket and log in the run dir


def _reference_forks(p: Policy) -> Forks | None:
    """engine.forkserver, unless the policy says false, when an engine command is
    `{python} -m engine ...`."""
    if p.engines.forkserver is False:
        return None
    commands = [p.engines.command, *(b.command for b in p.engines.batch if b.command)]
    if not any(is_forkable(c) for c in commands):
        return None
    return Forks([sys.executable, "-m", "engine.forkserver"], FORKABLE_ARGV, "forkserver")


def _vllm_forks(p: Policy) -> Forks | None:
    """holdfast_vllm.forkserver in the vLLM venv, on the CPU and on a CUDA device, unless the
    policy says false (then each engine is exec'd as vLLM's own command)."""
    if p.engines.forkserver is False:
        return None
    server, serves = vllm_kind.forkserver(p)
    return Forks(server, serves, "vllm-forkserver")


@dataclass(frozen=True)
class Kind:
    name: str
    # `p` with this kind's start command (engines.command, env, health) filled in
    resolve: Callable[[Policy], Policy] = _as_given
    errors: Callable[..., list[str]] = _no_errors  # (p, *, schema_only) -> what to change
    probes: tuple[Probe, ...] = ()  # beyond readiness and health (`HEALTH`)
    forks: Callable[[Policy], Forks | None] = _reference_forks  # its fork server, if any
    warms: bool = True  # keeps a stream's past warm (`POST /holdfast/warm`, engine/server.py)


KINDS: dict[str, Kind] = {
    k.name: k
    for k in (
        Kind("holdfast"),  # engines.command as given; the agent, or engines.health: http
        Kind("vllm", vllm_kind.resolve, vllm_kind.errors, (vllm_load,), _vllm_forks, warms=False),
    )
}


def kind_of(p: Policy) -> Kind:
    return KINDS[p.engines.kind]  # `EnginesSpec.kind` allows only these names


def forks(p: Policy) -> Forks | None:
    """The fork server `p`'s engines start from, if any (else each is exec'd)."""
    return kind_of(p).forks(p)


def probes(p: Policy) -> tuple[Probe, ...]:
    """What the launcher runs for each incarnation of `p`'s engines: readiness and health
    (`HEALTH[engines.health]`), then the kind's own."""
    return HEALTH[p.engines.health] + kind_of(p).probes
