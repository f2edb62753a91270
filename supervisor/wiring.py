"""How the cluster meets the parts built before it: the agents socket and the launcher it
sends and starts through (`Commands`, `Launcher`), the daemon pool (`Daemons`), and the
`Inbox` through which they report back to it."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Protocol

from holdfast_contract.agent_protocol import (
    Ack,
    Drain,
    Heartbeat,
    Hello,
    Promote,
    StateChange,
    Stop,
)
from supervisor.errors import SupervisorError
from supervisor.units import Daemon, Engine, Incarnation


class Commands(Protocol):
    """Where commands to engines go (`AgentHub`)."""

    def send(self, name: str, cmd: Promote | Drain | Stop) -> bool: ...

    def drain(self) -> None:
        """Take in now what the agents sent that is waiting to be read."""


class Launcher(Protocol):
    """What starts an engine's processes (`EngineLauncher`)."""

    async def spawn(self, e: Engine, epoch: int) -> Incarnation: ...


class Daemons(Protocol):
    """The cache daemons as the cluster sees them (`DaemonPool`)."""

    @property
    def daemons(self) -> Sequence[Daemon]: ...

    def all_serving(self) -> bool: ...

    def reconcile(self, now: float) -> float | None: ...

    def before_handout(self, engine: str) -> None: ...


class WiringError(SupervisorError):
    """Something was delivered to an `Inbox` before its cluster was attached."""


class Inbox:
    """What the agent hub, the launcher and the daemon pool report, delivered to the
    cluster. They are built before the `Cluster` (it sends and starts through them), so
    they are handed this inbox's methods; `attach` names the cluster once it exists."""

    def __init__(self) -> None:
        self._cluster: Handler | Detached = Detached()

    def attach(self, c: Handler) -> None:
        self._cluster = c

    def hello(self, msg: Hello) -> None:
        self._cluster.on_hello(msg)

    def heartbeat(self, msg: Heartbeat) -> None:
        self._cluster.on_heartbeat(msg)

    def state(self, msg: StateChange) -> None:
        self._cluster.on_state(msg)

    def ack(self, msg: Ack) -> None:
        self._cluster.on_ack(msg)

    def exit(self, e: Engine, inc: Incarnation, detail: str) -> None:
        self._cluster.on_exit(e, inc, detail)

    def http_beat(self, e: Engine, inc: Incarnation) -> None:
        self._cluster.on_http_beat(e, inc)

    def load(self, e: Engine, inc: Incarnation, in_flight: int, queued: int) -> None:
        self._cluster.on_load(e, inc, in_flight, queued)

    def kick(self) -> None:
        self._cluster.wake.set()

    def epoch(self) -> int:
        return self._cluster.epoch


class Detached:
    """An inbox's cluster before `Inbox.attach`: any delivery is a wiring bug."""

    @property
    def wake(self) -> asyncio.Event:
        raise WiringError("the daemon pool woke the cluster before Inbox.attach")

    @property
    def epoch(self) -> int:
        raise WiringError("the epoch was read before Inbox.attach")

    def __getattr__(self, name: str) -> Any:
        raise WiringError(f"{name} was delivered before Inbox.attach")


class Handler(Protocol):
    """What an `Inbox` delivers to (`Cluster`)."""

    wake: asyncio.Event
    epoch: int

    def on_hello(self, msg: Hello) -> None: ...

    def on_heartbeat(self, msg: Heartbeat) -> None: ...

    def on_state(self, msg: StateChange) -> None: ...

    def on_ack(self, msg: Ack) -> None: ...

    def on_exit(self, e: Engine, inc: Incarnation, detail: str) -> None: ...

    def on_http_beat(self, e: Engine, inc: Incarnation) -> None: ...

    def on_load(self, e: Engine, inc: Incarnation, in_flight: int, queued: int) -> None: ...
