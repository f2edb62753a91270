"""How the crew meets the parts built before it: the agents socket and the launcher it
sends and starts through (`Commands`, `Launcher`), the cache daemons (`Daemons`), what it
shares with the cache daemons (`Term`), and what the parts report to it (`Reports`,
handed to the agents socket's `serve` and to each `Launcher.spawn`)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from holdfast_contract.agent_protocol import (
    Ack,
    Drain,
    Heartbeat,
    Hello,
    Promote,
    Refit,
    Refitted,
    StateChange,
    Stop,
)
from supervisor.procs import Proc
from supervisor.units import Daemon, Engine, Incarnation
from supervisor.watcher import Command


@dataclass
class Term:
    """What the crew and the cache daemons share: the epoch (one more with each
    promotion) and the event that runs the reconcile loop's next tick now."""

    epoch: int = 0
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class AgentReports(Protocol):
    """What the agents report (`Crew`), as the agents socket delivers it."""

    def on_hello(self, msg: Hello) -> None: ...

    def on_heartbeat(self, msg: Heartbeat) -> None: ...

    def on_state(self, msg: StateChange) -> None: ...

    def on_ack(self, msg: Ack) -> None: ...

    def on_refitted(self, msg: Refitted) -> None: ...


class Reports(AgentReports, Protocol):
    """All the parts report (`Crew`): the agents, and an engine's exit, answered
    health check and load, as the launcher and its probes deliver them."""

    def on_exit(self, e: Engine, inc: Incarnation, detail: str) -> None: ...

    def on_http_beat(self, e: Engine, inc: Incarnation) -> None: ...

    def on_load(self, e: Engine, inc: Incarnation, in_flight: int, queued: int) -> None: ...


class Commands(Protocol):
    """Where commands to engines go (`AgentHub`)."""

    def send(self, name: str, cmd: Promote | Drain | Stop | Refit) -> bool: ...

    def drain(self, into: AgentReports) -> None:
        """Deliver to `into` now what the agents sent that is waiting to be read."""


class Launcher(Protocol):
    """What starts an engine's processes (`EngineLauncher`)."""

    async def spawn(self, e: Engine, epoch: int, into: Reports) -> Incarnation:
        """Start `e`'s processes; its exit and health checks are reported to `into`."""


class ParkedDaemons(Protocol):
    """Cache daemons started ahead (supervisor/update/parked.py): `claim` hands one the
    command a daemon of rank `d` would start with, or says None."""

    async def claim(self, d: Daemon, cmd: Command) -> Proc | None: ...


class Daemons(Protocol):
    """The cache daemons as the crew sees them (`CacheDaemons`)."""

    @property
    def daemons(self) -> Sequence[Daemon]: ...

    @property
    def generation(self) -> int: ...

    def all_serving(self) -> bool: ...

    def reconcile(self, now: float) -> float | None: ...

    def before_handout(self, engine: str) -> None: ...

    def kv_ident(self, key: str) -> str: ...  # which KV cache the keeper holds under `key`

    def drop_kv(self, engine: str) -> None: ...  # its shared KV cache, out of the keeper
