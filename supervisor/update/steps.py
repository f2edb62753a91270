"""What a rolling update and a refit share (supervisor/update/rollout.py drives both;
refit.py is a refit's own steps): the generations of daemons and which one serves, the
serving engines added for a version, a version refused with nothing lost, the old
primary's drain, the old pool kept for a rollback then freed, and what each step says
(`update.main.<event>` events, the crew's `UpdateStatus`)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import structlog

from holdfast_contract.agent_protocol import Drain
from holdfast_contract.control import UpdateState, UpdateStatus
from holdfast_contract.events import EventName as N
from supervisor.backoff import RestartBook
from supervisor.core import Crew
from supervisor.daemons import CacheDaemons
from supervisor.engines import EngineLauncher
from supervisor.units import Engine
from supervisor.update import memory
from supervisor.update.generations import Generations
from supervisor.versions import Source

log = structlog.get_logger("supervisor.update")


class Steps:
    """The state of the crew's updates and the steps they share."""

    def __init__(self, c: Crew, first: CacheDaemons, launcher: EngineLauncher) -> None:
        self.c = c
        self.gens = Generations(first)
        self.current = first  # the generation the router's primary serves
        self.kept: CacheDaemons | None = None  # the one before, until keep_old_s passed
        self.launcher = launcher
        self.spec = c.policy.update
        self.closing = False  # the supervisor stops: no rollback of what was cut short

    def add_serving(self, src: Source, count: int = 0) -> list[Engine]:
        """`count` serving engines of `src`'s version (0: as many as the policy has, a
        primary and its standbys), named after the highest serving one; started by the
        next tick."""
        p, c = self.c.policy, self.c
        top = max((int(n[1:]) for n in c.engines if n[1:].isdigit() and n[0] == "e"), default=0)
        made = [
            Engine(
                name=f"e{top + 1 + i}",
                group="serving",
                role="standby",
                book=RestartBook(p.restart),
                memory_mb=p.engines.memory_mb,
                command=list(p.engines.command),
                source=src,
            )
            for i in range(count or p.engines.primary + p.engines.standby)
        ]
        for e in made:
            c.engines[e.name] = e
        c.wake.set()
        return made

    async def refused(
        self, gen: CacheDaemons, engines: list[Engine], why: str, *, built: bool
    ) -> None:
        """Nothing was routed to `gen`'s version: its engines retire; a pool built for it
        is freed. The version that served goes on."""
        self.status("rolling-back", detail=why)
        for e in engines:
            if e.name in self.c.engines:
                await self.c.retire(e)
        if built:
            await self.free(gen)
        if missing := memory.standbys_missing(self.c):  # stopped for room: started again
            self.add_serving(self.launcher.source, missing)
        self.emit(N.ROLLED_BACK, why=why, version=self.c.version)
        self.status("rolled-back", detail=why)
        log.warning("update rolled back", why=why, version=self.c.version)

    async def keep_then_free(self, src: Source, *, back: bool) -> None:
        """Keep the old pool update.keep_old_s for a rollback (a version rolled back from is
        not kept), then free it; the update's end."""
        keep = 0.0 if back else self.spec.keep_old_s
        until = time.time() + keep
        self.status("keeping", keep_until=until, detail="the old pool is kept for a rollback")
        await asyncio.sleep(keep)
        if self.kept is not None:
            await self.free(self.kept)
        self.emit(N.FINISHED, version=src.version, engines=versions(self.c))
        self.status("rolled-back" if back else "finished", detail="")

    async def drain(self, old: Engine) -> None:
        """The superseded primary finishes its requests in flight and exits (Drain) within
        update.drain_s; past it, it is killed (what it had not finished ends with an
        error, supervisor/proxy/cuts.py), then it retires."""
        inc = old.inc
        if inc is not None:
            self.c.hub.send(old.name, Drain(grace_s=self.spec.drain_s))
            try:
                async with asyncio.timeout(self.spec.drain_s):
                    await asyncio.gather(*(p.wait() for p in inc.procs))
            except TimeoutError:
                log.warning("drain deadline passed", engine=old.name, in_flight=old.in_flight)
                await asyncio.gather(*(p.fence() for p in inc.procs))
        await self.c.retire(old)

    async def free(self, gen: CacheDaemons) -> None:
        fps = await self.gens.free(gen)
        if self.kept is gen:
            self.kept = None
        self.c.bus.emit(
            "update",
            "main",
            N.POOL_FREED,
            self.c.epoch,
            generation=gen.generation,
            version=gen.version,
            withdrawn=fps,
        )

    # ---- what it says ----
    def status(self, state: UpdateState | str, **changes: Any) -> None:
        st = self.c.update
        if st is None or state == "building":
            st = UpdateStatus(
                state="building",
                version_from=self.c.version,
                version_to="",
                model="",
                started=time.time(),
                kind="update",
            )
        self.c.update = msgspec.structs.replace(st, state=state, **changes)

    def emit(self, event: N, **data: Any) -> None:
        self.c.bus.emit("update", "main", event, self.c.epoch, **data)


def versions(engines: Any) -> dict[str, str]:
    """Each engine's version, by name (a list of engines, or a crew's)."""
    found = engines.engines.values() if isinstance(engines, Crew) else engines
    return {e.name: e.version for e in found}
