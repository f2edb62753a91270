"""What an engine kind is (`Kind`), and what every kind shares: the readiness and health
probes of `engines.health` (`HEALTH`), the fork server a kind may have (`Forks`), and the
stream shape of an OpenAI-style engine that returns token ids (`StreamShape`).

A kind owns five things: its policy section (`section`, a msgspec struct read from
`engines.<name>`, and `settings` to read it back), its start command (`resolve` writes its
argv template, environment and health into the policy; `engines.EngineLauncher` renders
them per rank), its probes (readiness and health from `engines.health`, then its own:
`probes`), its stream shape (`stream`: where a streamed chunk carries token ids), and
whether it keeps a stream's past warm (`warms`, `POST /holdfast/warm`). What a silence or
a missed deadline means is judged in `decisions.liveness`, not here.

A probe runs as a task of the launcher's `Watcher` for as long as the incarnation lives,
and reports what it sees through `Reports`: a 200 of its health (ready, alive), and the
engine's load. It writes nothing of the engine itself: `core.Crew` owns engine state.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import aiohttp
import msgspec

if TYPE_CHECKING:
    from supervisor.policy import Policy
    from supervisor.units import Engine, Incarnation


class Reports(Protocol):
    """Where a probe reports: the crew (`core.Crew`), as `Launcher.spawn` is given it."""

    def on_http_beat(self, e: Engine, inc: Incarnation) -> None: ...

    def on_load(self, e: Engine, inc: Incarnation, in_flight: int, queued: int) -> None: ...


# a probe: runs while the incarnation lives; reports a 200 (ready, alive) and load
Probe = Callable[["Engine", "Incarnation", "Policy", Reports], Coroutine[Any, Any, None]]


async def http_health(e: Engine, inc: Incarnation, p: Policy, reports: Reports) -> None:
    """Heartbeats for engines without the agent: GET /health on their port."""
    interval = p.heartbeat.interval_ms / 1000.0
    timeout = aiohttp.ClientTimeout(total=max(interval, 0.5))
    async with aiohttp.ClientSession(timeout=timeout) as http:
        while not inc.handled and e.inc is inc:
            try:
                async with http.get(f"http://127.0.0.1:{e.port}/health") as r:
                    if r.status == 200:
                        reports.on_http_beat(e, inc)
            except (aiohttp.ClientError, OSError, TimeoutError):
                pass
            await asyncio.sleep(interval)


# readiness and health probes per `engines.health`; "agent": the agents socket brings both
HEALTH: dict[str, tuple[Probe, ...]] = {"agent": (), "http": (http_health,)}


@dataclass(frozen=True)
class Forks:
    """A fork server for a kind: the command that runs it (`--socket PATH` is added), and
    the head of the engine commands it forks (the rest of each travels in the request)."""

    server: list[str]
    serves: list[str]
    name: str  # of its socket and log in the run dir


class StreamShape:
    """Where a streamed chunk of an engine carries the ids the router replays after a cut
    (supervisor/proxy/migration.py): vLLM's `return_token_ids` extension, which the reference
    engine speaks too. A completion chunk's choice carries its tokens' `token_ids` and the
    first one the prompt's `prompt_token_ids`; a chat chunk carries the prompt's beside
    its choices."""

    def token_ids(self, choice: dict[str, Any]) -> list[int]:
        return list(choice.get("token_ids") or ())

    def prompt_ids(self, part: dict[str, Any]) -> list[int] | None:
        ids = part.get("prompt_token_ids")
        return list(ids) if isinstance(ids, list) else None


TOKEN_IDS = StreamShape()


class Kind:
    """An engine kind: subclass it, set `name` (the policy's `engines.kind`), and override
    what differs from an engine started by `engines.command` as given."""

    name: ClassVar[str]
    # the kind's own policy section, `engines.<name>` (None: it has none)
    section: ClassVar[type[msgspec.Struct] | None] = None
    warms: ClassVar[bool] = True  # keeps a stream's past warm (engine/server.py)
    stream: ClassVar[StreamShape] = TOKEN_IDS

    def settings(self, p: Policy) -> Any:
        """`p`'s section of this kind, as its `section` type (its defaults when unset)."""
        if self.section is None:
            return None
        given = p.engines.section
        if isinstance(given, self.section):
            return given
        return msgspec.convert(given or {}, self.section)

    def resolve(self, p: Policy) -> Policy:
        """`p` with this kind's start command (engines.command, env, health) filled in."""
        return p

    def errors(self, p: Policy, *, schema_only: bool) -> list[str]:
        """What keeps `p`'s engines of this kind from running, each naming what to change;
        with `schema_only`, none that look at this machine."""
        return []

    def own_probes(self, p: Policy) -> tuple[Probe, ...]:
        """Probes beyond readiness and health (`HEALTH`)."""
        return ()

    def probes(self, p: Policy) -> tuple[Probe, ...]:
        """What the launcher runs for each incarnation of `p`'s engines: readiness and
        health (`HEALTH[engines.health]`), then the kind's own."""
        return HEALTH[p.engines.health] + self.own_probes(p)

    def forks(self, p: Policy) -> Forks | None:
        """The fork server `p`'s engines start from, if any (else each is exec'd)."""
        return None

    def daemon_runtime(self, p: Policy) -> tuple[str, str]:
        """The python and `--layout` of `p`'s cache daemons."""
        return sys.executable, "reference"
