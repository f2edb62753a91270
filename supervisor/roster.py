"""The engines a supervisor runs, and the one way an engine's state changes.

`Roster` holds every engine, the primary and the term it serves in (`wiring.Term`: the
epoch, and the wake-up of the reconcile loop); each change of an engine's state is one
row of `states.ENGINE`, made by `_move` and published as that row's event, with the
engine's retained state. The failover core (`failover.Failover`) and the crew
(`core.Crew`) build on it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import Any

from holdfast_contract.events import EventName as N
from supervisor import decisions
from supervisor.events import EngineUnitState, EventBus
from supervisor.kinds import kind_of
from supervisor.policy import Policy
from supervisor.primary import PrimaryView, Target
from supervisor.states import ENGINE, EngineState, move
from supervisor.units import Engine, Want, engines_of
from supervisor.wiring import Term


class Roster:
    """The engines, the primary, the term; every state change and its event."""

    def __init__(self, policy: Policy, bus: EventBus, view: PrimaryView, term: Term) -> None:
        self.policy = policy
        self.bus = bus
        self.view = view
        self.term = term
        self.primary: Engine | None = None
        self.windows = decisions.Windows.of(policy)
        self.engines: dict[str, Engine] = {e.name: e for e in engines_of(policy)}
        self.warms = policy.router.warm_every > 0 and kind_of(policy).warms
        # the model version the router's primary serves: only its standbys are promoted
        self.version = ""
        # the version whose standby the router keeps streams' pasts warm on, when not the
        # one served: a refit's, between its standbys' refit and its switch (warm_next)
        self.warm_version = ""
        # a refit's new primary, while the superseded one still runs the streams it is
        # about to cut (update.refit_inflight: retry): their pasts go on being kept warm
        # there, where they go on (`warm_through_cut`)
        self.warm_primary: Engine | None = None
        self._moved = asyncio.Event()  # set, and replaced, at each move

    @property
    def epoch(self) -> int:
        return self.term.epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        self.term.epoch = value

    @property
    def wake(self) -> asyncio.Event:
        """Set to run the reconcile loop's next tick now."""
        return self.term.wake

    # ---- the one way an engine's state changes ----
    def _move(self, e: Engine, event: N, to: EngineState | None = None, **data: Any) -> None:
        """Make the move the table has for (e.state, event[, to]) and publish `event`;
        raises IllegalTransition when there is no such row."""
        move(e, ENGINE, event, to)
        self.publish(e, event, **data)
        self._name_heir()
        self._moved.set()
        self._moved = asyncio.Event()

    async def until(self, done: Callable[[], bool]) -> None:
        """Until `done()` holds, looked at after each move of any engine."""
        while not done():
            await self._moved.wait()

    def _name_heir(self) -> None:
        """Tell the router which standby is promoted next: it keeps streams' pasts warm
        there (router.warm_every), if this kind of engine keeps them."""
        h = self._warm_standby() if self.warms else None
        now = self.view.heir
        if h is None:
            self.view.heir = None
        elif now is None or (now.name, now.port, now.version) != (h.name, h.port, h.version):
            self.view.heir = Target(h.name, h.port, 0, version=h.version)

    def warm_next(self, version: str) -> Engine | None:
        """Until the next switch, streams' pasts are kept warm on a standby of `version`,
        not of the version served (a refit whose cut streams go on there,
        supervisor/update/refit.py); "" for the version served again. The standby named."""
        self.warm_version = version
        self._name_heir()
        heir = self.view.heir
        return self.engines.get(heir.name) if heir is not None else None

    def warm_through_cut(self, e: Engine | None) -> None:
        """Until the superseded primary has cut its streams (a refit's retry), the router
        keeps their pasts warm on `e`, the new primary they go on on: tokens made between
        the switch and the cut are then not computed again there. None once it has."""
        self.warm_primary = e
        self._name_heir()

    def _warm_standby(self) -> Engine | None:
        if self.warm_primary is not None and self.warm_primary is self.primary:
            return self.warm_primary
        if not self.warm_version or self.warm_version == self.version:
            return self.best_standby()
        ours = [e for e in self.engines.values() if e.version == self.warm_version]
        return decisions.best_standby(ours, time.monotonic(), self.windows.hang_s)

    def best_standby(self) -> Engine | None:
        """The standby to promote: the one the router keeps pasts warm on, if ready."""
        heir = self.view.heir.name if self.view.heir is not None else None
        ours = [e for e in self.engines.values() if e.version == self.version]
        return decisions.best_standby(ours, time.monotonic(), self.windows.hang_s, prefer=heir)

    def publish(self, e: Engine, event: str, **data: Any) -> None:
        data.setdefault("pid", e.pid)
        self.bus.emit(
            "engine", e.name, event, self.epoch, role=e.role, state=e.state, port=e.port, **data
        )
        self._retain(e)

    def _retain(self, e: Engine) -> None:
        """Publish `e`'s retained state: its state and what the rules want of it."""
        now, wall = time.monotonic(), time.time()
        self.bus.state(
            EngineUnitState(
                ts=wall,
                kind="engine",
                name=e.name,
                state=e.state,
                epoch=self.epoch,
                role=e.role,
                pid=e.pid,
                wanted=e.wanted.wire(now, wall) if e.wanted is not None else None,
            )
        )

    def want(self, wants: Mapping[str, Want]) -> None:
        """What the rules want of each engine now, by name (`BatchGovernor.wants`): kept
        for its status, and its retained state published again where it changed (no
        event: its state did not move)."""
        for name, w in wants.items():
            e = self.engines[name]
            if e.wanted != w:
                e.wanted = w
                self._retain(e)
