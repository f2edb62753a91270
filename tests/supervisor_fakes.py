"""Stand-ins for what a unit test of the supervisor's decisions cannot have: engine and
daemon processes (`FakeProc`), the launcher that starts them, and the agents socket the
supervisor sends commands through. The event bus, the primary view and the cache daemons'
inotify watch stay real."""

from __future__ import annotations

import asyncio
import itertools
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from holdfast_contract.agent_protocol import Drain, Promote, Stop
from holdfast_contract.events import Event
from supervisor.core import Crew
from supervisor.errors import StartupError
from supervisor.events import EventBus
from supervisor.policy import (
    BatchSpec,
    EnginesSpec,
    EventsSpec,
    HeartbeatSpec,
    Policy,
    RestartSpec,
)
from supervisor.primary import PrimaryView
from supervisor.units import Daemon, Engine, Incarnation
from supervisor.wiring import AgentReports, Reports, Term

_pids = itertools.count(4_000_000)


class FakeProc:
    """A process handle whose exit the test decides: `exit(code)`; with `hold` set, the
    first `terminate` waits for `release` (an engine that takes its grace period)."""

    def __init__(self) -> None:
        self.pid = next(_pids)
        self.signals: list[int] = []
        self.signalled_alive = False  # signalled while it still ran
        self.code: int | None = None
        self.hold = False
        self._exited = asyncio.Event()
        self.terminating = asyncio.Event()
        self.release = asyncio.Event()

    @property
    def alive(self) -> bool:
        return not self._exited.is_set()

    @property
    def returncode(self) -> int | None:
        return None if self.alive else self.code

    @property
    def signalled(self) -> bool:
        return self.signalled_alive

    def exit(self, code: int) -> None:
        self.code = code
        self._exited.set()

    async def wait(self) -> int | None:
        await self._exited.wait()
        return self.code

    def kill_group(self, sig: int = signal.SIGKILL) -> None:
        self.signalled_alive = self.signalled_alive or self.alive
        self.signals.append(sig)
        if sig == signal.SIGKILL:
            self.exit(-sig)

    async def fence(self, timeout: float = 2.0) -> bool:
        self.kill_group(signal.SIGKILL)
        return True

    async def terminate(self, grace: float) -> None:
        first = not self.terminating.is_set()
        self.signals.append(signal.SIGTERM)
        self.terminating.set()
        if self.hold and first:  # a second terminate (the supervisor stops) does not wait
            await self.release.wait()
        self.exit(-signal.SIGTERM)

    def tail(self, limit: int = 1024, window: int = 64 * 1024) -> str:
        return f"last lines of {self.pid}"


@dataclass
class FakeHub:
    sent: list[tuple[str, Promote | Drain | Stop]] = field(default_factory=list)
    connected: bool = True

    def send(self, name: str, cmd: Promote | Drain | Stop) -> bool:
        self.sent.append((name, cmd))
        return self.connected

    def drain(self, into: AgentReports) -> None:
        """Nothing waits unread: this hub has no socket."""


@dataclass
class FakeLauncher:
    fail: str = ""  # the StartupError message of the next spawns, when set
    started: list[Incarnation] = field(default_factory=list)

    async def spawn(self, e: Engine, epoch: int, into: Reports) -> Incarnation:
        if self.fail:
            raise StartupError(self.fail)
        e.port = 9000 + len(self.started)
        inc = Incarnation([FakeProc()])
        self.started.append(inc)
        return inc


@dataclass
class NoDaemons:
    daemons: list[Daemon] = field(default_factory=list)
    generation: int = 1

    def all_serving(self) -> bool:
        return True

    def reconcile(self, now: float) -> float | None:
        return None

    def before_handout(self, engine: str) -> None:
        pass

    def kv_ident(self, key: str) -> str:
        return ""

    def drop_kv(self, engine: str) -> None:
        pass


def policy(**engines: Any) -> Policy:
    spec = EnginesSpec(
        primary=1,
        standby=2,
        batch=[BatchSpec(name="b", count=1)],
        stop_grace_s=0.5,
        **engines,
    )
    return Policy(
        engines=spec,
        restart=RestartSpec(max_restarts=2, window_s=60.0),
        heartbeat=HeartbeatSpec(exit_poll_ms=0),  # no /proc polling of fake pids
    )


class Events:
    """What the bus published, from an in-process subscription."""

    def __init__(self, bus: EventBus) -> None:
        self._q = bus.subscribe()
        self.seen: list[Event] = []

    def drain(self) -> list[Event]:
        while not self._q.empty():
            self.seen.append(self._q.get_nowait())
        return self.seen

    def mark(self) -> int:
        return len(self.drain())

    def since(self, mark: int, name: str | None = None) -> list[Event]:
        return [e for e in self.drain()[mark:] if name is None or e.name == name]


@dataclass
class Rig:
    c: Crew
    hub: FakeHub
    launcher: FakeLauncher
    events: Events
    bus: EventBus


@asynccontextmanager
async def bus_at(run: Path) -> AsyncIterator[EventBus]:
    bus = EventBus(f"ipc://{run}/events", EventsSpec())
    try:
        yield bus
    finally:
        await bus.close()


@asynccontextmanager
async def rig(run: Path, p: Policy | None = None) -> AsyncIterator[Rig]:
    """A Crew over fakes, with a real event bus at ipc://<run>/events."""
    async with bus_at(run) as bus:
        hub, launcher = FakeHub(), FakeLauncher()
        events = Events(bus)
        c = Crew(
            p or policy(),
            bus,
            PrimaryView(),
            Term(),
            hub=hub,
            launcher=launcher,
            daemons=NoDaemons(),
        )
        yield Rig(c, hub, launcher, events, bus)
