"""A rolling model update, carried out: the next version's cache daemons build its pool
while the current one serves; standbys of the new version start on it and warm; one
answers the policy's smoke request; the primary's place passes to it in one fenced,
epoch-raising step (`Failover.switch`); the old primary finishes its requests in flight
(`update.drain_s`, then it is stopped and whatever it still made ends with an error: an
answer is never continued on another version); the old standbys retire; batch engines
restart on the new pool; the old pool is kept `update.keep_old_s` for a rollback, then its
daemons stop and it leaves escrow. A new version that fails before the switch is rolled
back with nothing lost: the old one served throughout. `supervisor rollback` does that by
hand, or, after the switch while the old pool is kept, switches back to it the same way.

Each step is an `update.main.<event>` event (`started`, `ready`, `switched`,
`rolled-back`, `pool-freed`, `finished`) and the crew's `UpdateStatus` (`supervisor status`)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import msgspec
import structlog

from holdfast_contract.agent_protocol import Drain
from holdfast_contract.control import RefitReq, UpdateReq, UpdateState, UpdateStatus
from holdfast_contract.events import EventName as N
from supervisor.backoff import RestartBook
from supervisor.core import Crew
from supervisor.daemons import CacheDaemons
from supervisor.engines import EngineLauncher
from supervisor.errors import ControlError, StartupError
from supervisor.states import EngineState
from supervisor.units import Engine
from supervisor.update import memory, refit
from supervisor.update.checks import checkpoint_refusals
from supervisor.update.generations import Generations
from supervisor.update.smoke import SmokeFailed, smoke
from supervisor.update.waits import NotReady, SameVersion, ready, why
from supervisor.versions import Source

log = structlog.get_logger("supervisor.update")
S = EngineState
UNDER_WAY = frozenset({"building", "warming", "refitting", "switching", "draining"})


class Rollout:
    """The crew's rolling updates, one at a time, in a task of its own."""

    def __init__(self, c: Crew, first: CacheDaemons, launcher: EngineLauncher) -> None:
        self.c = c
        self.gens = Generations(first)
        self.current = first  # the generation the router's primary serves
        self.kept: CacheDaemons | None = None  # the one before, until keep_old_s passed
        self.launcher = launcher
        self.spec = c.policy.update
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    # ---- control ----
    async def update(self, req: UpdateReq) -> str:
        """Start an update to `req.model`, or refuse it, saying what to fix."""
        self._refuse_if_busy()
        cur = self.current
        m = cur.policy.model
        dtype, quant = req.dtype or m.dtype, req.quantization or m.quantization
        new = Path(req.model)
        if new.resolve() == Path(cur.model_dir).resolve() and (dtype, quant) == (
            m.dtype,
            m.quantization,
        ):
            raise ControlError(
                f"--model {new} is the checkpoint that serves now, held as {dtype}/{quant}; "
                "give the dir of the next version"
            )
        refused = await asyncio.to_thread(checkpoint_refusals, Path(cur.model_dir), new)
        if refused:
            raise ControlError("; ".join(refused))
        room = await memory.for_update(self.c, cur, new, dtype, quant)  # or ControlError
        gen = self.gens.make(str(new), dtype, quant)
        self._status("building", version_to="", model=str(new), detail="loading the new pool")
        self._start(self._go(gen, build=True, give_up=room.give_up))
        return (
            f"updating to {new} ({dtype}/{quant}); `supervisor status` follows it\n{room.summary()}"
        )

    async def refit(self, req: RefitReq) -> str:
        """Start a refit to the weights in `req.model` (same names and shapes), or refuse
        it, saying what to fix (supervisor/update/refit.py)."""
        self._refuse_if_busy()
        why = refit.refusal(self.c)
        if why:
            raise ControlError(why)
        cur = self.current
        new = Path(req.model)
        if new.resolve() == Path(cur.model_dir).resolve():
            raise ControlError(
                f"--model {new} is the checkpoint that serves now; give the dir of the new weights"
            )
        refused = await asyncio.to_thread(checkpoint_refusals, Path(cur.model_dir), new)
        if refused:
            raise ControlError("; ".join(refused))
        m = cur.policy.model
        gen = self.gens.make(str(new), m.dtype, m.quantization)
        self._status("building", model=str(new), kind="refit", detail="loading the new pool")
        self._start(refit.go(self, gen))
        return f"refitting to {new}; `supervisor status` follows it"

    def _refuse_if_busy(self) -> None:
        st = self.c.update
        if st is not None and st.state in UNDER_WAY | {"rolling-back", "keeping"}:
            raise ControlError(
                f"an {st.kind} to version {st.version_to or '?'} ({st.model}) is under way "
                f"({st.state}); wait for it to finish (`supervisor status`), or "
                "`supervisor rollback`"
            )
        if self.c.policy.cluster is not None:
            raise ControlError("a fleet node is not updated alone; update each node's policy")

    async def rollback(self) -> str:
        """Before the switch: stop the new version (nothing was routed to it). After it,
        while the old pool is kept: switch back to it, as an update would."""
        st = self.c.update
        if (
            st is not None
            and st.state in ("building", "warming", "refitting")
            and self._task is not None
        ):
            self._task.cancel()  # its engines retire, its pool is freed: `rolled-back`
            return f"rolling back: version {self.c.version} serves on"
        if st is not None and st.state in ("switching", "draining", "rolling-back"):
            raise ControlError(
                f"the update is {st.state}; roll back once it keeps the old pool "
                "(`supervisor status`: update keeping)"
            )
        kept = self.kept
        if kept is None:
            raise ControlError(
                "nothing to roll back to: no update is under way, and the pool the last "
                "update replaced is freed (update.keep_old_s); run `supervisor update "
                "--model` with the old checkpoint"
            )
        await self._cancel()
        self._status("rolling-back", version_to=kept.version, model=kept.model_dir)
        self._start(self._go(kept, build=False, back=True))
        return f"rolling back to version {kept.version}; `supervisor status` follows it"

    async def close(self) -> None:
        """The supervisor stops: the update under way ends where it is (the engines and
        the daemons are stopped next, every generation: `stop_daemons`)."""
        self._closing = True
        await self._cancel()

    async def stop_daemons(self) -> None:
        await self.gens.stop()

    # ---- the steps ----
    def _start(self, coro: Coroutine[Any, Any, None]) -> None:
        self._task = asyncio.get_running_loop().create_task(self._guarded(coro), name="update")

    async def _guarded(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run one update; a failure of its own (a bug, a process that cannot be signalled)
        ends it with the reason in its status, so the next update is not refused."""
        try:
            await coro
        except Exception as e:
            log.exception("update failed", version=self.c.version)
            st = self.c.update
            done = st is not None and st.version_to == self.c.version
            self._status("finished" if done else "rolled-back", detail=f"stopped short: {e!r}")

    async def _cancel(self) -> None:
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _go(
        self, gen: CacheDaemons, *, build: bool, back: bool = False, give_up: bool = False
    ) -> None:
        """One update (or a switch back, `back`) to `gen`'s pool; `give_up`: the old
        standbys stop first, for room (update.free_standby_kv)."""
        self._emit(N.STARTED, model=gen.model_dir, back=back)
        engines: list[Engine] = []
        try:
            async with asyncio.timeout(self.spec.ready_timeout_s):
                if give_up:
                    stopped = await memory.stop_standbys(self.c)
                    log.info("old standbys stopped for room", engines=stopped)
                if build:
                    await gen.start()
                src = gen.source()
                if src.version == self.c.version:
                    raise SameVersion(
                        f"{gen.model_dir} holds the bytes of the version that serves "
                        f"({src.version}): nothing to update"
                    )
                self._status("warming", version_to=src.version, detail="standbys start")
                engines = self._add_serving(src)
                await self.c.until(lambda: ready(engines))
                if self.spec.smoke is not None:
                    await smoke(engines[0], self.spec.smoke)
            self._emit(N.READY, version=src.version, engines=_versions(engines))
        except (TimeoutError, StartupError, NotReady, SmokeFailed, SameVersion) as e:
            await self._refused(gen, engines, why(e, self.spec.ready_timeout_s), built=build)
            return
        except asyncio.CancelledError:
            if not self._closing:  # `supervisor rollback` by hand
                await self._refused(gen, engines, "rolled back by hand", built=build)
            raise
        await self._switch(gen, src, engines, back)

    def _add_serving(self, src: Source, count: int = 0) -> list[Engine]:
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

    async def _refused(
        self, gen: CacheDaemons, engines: list[Engine], why: str, *, built: bool
    ) -> None:
        """Nothing was routed to `gen`'s version: its engines retire; a pool built for it
        is freed. The version that served goes on."""
        self._status("rolling-back", detail=why)
        for e in engines:
            if e.name in self.c.engines:
                await self.c.retire(e)
        if built:
            await self._free(gen)
        if missing := memory.standbys_missing(self.c):  # stopped for room: started again
            self._add_serving(self.launcher.source, missing)
        self._emit(N.ROLLED_BACK, why=why, version=self.c.version)
        self._status("rolled-back", detail=why)
        log.warning("update rolled back", why=why, version=self.c.version)

    async def _switch(
        self, gen: CacheDaemons, src: Source, engines: list[Engine], back: bool
    ) -> None:
        c, before = self.c, self.c.version
        heir = next((e for e in engines if e.state == S.STANDBY), None)
        if heir is None:  # (each was ready a moment ago)
            await self._refused(
                gen, engines, "no new engine was ready at the switch", built=not back
            )
            return
        self._status("switching")
        old = c.switch(heir)
        c.daemons, self.launcher.source = gen, src
        self.kept, self.current = self.current, gen
        self._emit(N.SWITCHED, version=src.version, previous=before, engines=_versions(c))
        if back:
            self._emit(N.ROLLED_BACK, why="rolled back by hand", version=src.version)
        self._status("draining", detail="the old primary finishes its requests")
        if old is not None:
            await self._drain(old)
        for e in [e for e in c.engines.values() if e.serving and e.version != src.version]:
            await c.retire(e)
        for e in [e for e in c.engines.values() if not e.serving and e.version != src.version]:
            e.source = src  # batch engines follow: restarted on the new pool
            if e.running and e.state != S.DRAINING:
                with contextlib.suppress(ControlError):  # (being stopped already)
                    await c.restart(e)
        await self._keep_then_free(src, back=back)

    async def _keep_then_free(self, src: Source, *, back: bool) -> None:
        """Keep the old pool update.keep_old_s for a rollback (a version rolled back from is
        not kept), then free it; the update's end."""
        keep = 0.0 if back else self.spec.keep_old_s
        until = time.time() + keep
        self._status("keeping", keep_until=until, detail="the old pool is kept for a rollback")
        await asyncio.sleep(keep)
        if self.kept is not None:
            await self._free(self.kept)
        self._emit(N.FINISHED, version=src.version, engines=_versions(self.c))
        self._status("rolled-back" if back else "finished", detail="")

    async def _drain(self, old: Engine) -> None:
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

    async def _free(self, gen: CacheDaemons) -> None:
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
    def _status(self, state: UpdateState | str, **changes: Any) -> None:
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

    def _emit(self, event: N, **data: Any) -> None:
        self.c.bus.emit("update", "main", event, self.c.epoch, **data)


def _versions(engines: Any) -> dict[str, str]:
    """Each engine's version, by name (a list of engines, or a crew's)."""
    found = engines.engines.values() if isinstance(engines, Crew) else engines
    return {e.name: e.version for e in found}
