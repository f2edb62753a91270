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
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import structlog

from holdfast_contract.control import RefitReq, UpdateReq
from holdfast_contract.events import EventName as N
from supervisor.core import Crew
from supervisor.daemons import CacheDaemons
from supervisor.engines import EngineLauncher
from supervisor.errors import ControlError, StartupError
from supervisor.states import EngineState
from supervisor.units import Engine
from supervisor.update import memory, refit
from supervisor.update.checks import checkpoint_refusals
from supervisor.update.smoke import SmokeFailed, smoke
from supervisor.update.steps import Steps, versions
from supervisor.update.waits import NotReady, SameVersion, heir, why
from supervisor.versions import Source

log = structlog.get_logger("supervisor.update")
S = EngineState
UNDER_WAY = frozenset({"building", "warming", "refitting", "switching", "draining"})


class Rollout(Steps):
    """The crew's rolling updates and refits, one at a time, in a task of its own."""

    def __init__(self, c: Crew, first: CacheDaemons, launcher: EngineLauncher) -> None:
        super().__init__(c, first, launcher)
        self._task: asyncio.Task[None] | None = None

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
        self.status("building", version_to="", model=str(new), detail="loading the new pool")
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
        room = await memory.for_update(
            self.c, cur, new, m.dtype, m.quantization, new_engines=False
        )  # or ControlError
        if room.give_up:
            raise ControlError(
                f"a refit stops no standby, and the new pool fits only once they stop: "
                f"{room.summary()}; free memory (evict a batch engine), or lower "
                "engines.standby"
            )
        gen = self.gens.make(str(new), m.dtype, m.quantization)
        self.status("building", model=str(new), kind="refit", detail="loading the new pool")
        self._start(refit.go(self, gen))
        return f"refitting to {new}; `supervisor status` follows it\n{room.summary()}"

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
        self.status("rolling-back", version_to=kept.version, model=kept.model_dir)
        self._start(self._go(kept, build=False, back=True))
        return f"rolling back to version {kept.version}; `supervisor status` follows it"

    async def close(self) -> None:
        """The supervisor stops: the update under way ends where it is (the engines and
        the daemons are stopped next, every generation: `stop_daemons`)."""
        self.closing = True
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
            self.status("finished" if done else "rolled-back", detail=f"stopped short: {e!r}")

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
        self.emit(N.STARTED, model=gen.model_dir, back=back)
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
                self.status("warming", version_to=src.version, detail="standbys start")
                engines = self.add_serving(src)
                await self.c.until(lambda: heir(engines) is not None)
                if self.spec.smoke is not None:
                    await smoke(heir(engines) or engines[0], self.spec.smoke)
            self.emit(N.READY, version=src.version, engines=versions(engines))
        except (TimeoutError, StartupError, NotReady, SmokeFailed, SameVersion) as e:
            await self.refused(gen, engines, why(e, self.spec.ready_timeout_s), built=build)
            return
        except asyncio.CancelledError:
            if not self.closing:  # `supervisor rollback` by hand
                await self.refused(gen, engines, "rolled back by hand", built=build)
            raise
        await self._switch(gen, src, engines, back)

    async def _switch(
        self, gen: CacheDaemons, src: Source, engines: list[Engine], back: bool
    ) -> None:
        c, before = self.c, self.c.version
        heir = next((e for e in engines if e.state == S.STANDBY), None)
        if heir is None:  # (one was ready a moment ago)
            await self.refused(
                gen, engines, "no new engine was ready at the switch", built=not back
            )
            return
        self.status("switching")
        old = c.switch(heir)
        c.daemons, self.launcher.source = gen, src
        self.kept, self.current = self.current, gen
        self.emit(N.SWITCHED, version=src.version, previous=before, engines=versions(c))
        if back:
            self.emit(N.ROLLED_BACK, why="rolled back by hand", version=src.version)
        self.status("draining", detail="the old primary finishes its requests")
        if old is not None:
            await self.drain(old)
        for e in [e for e in c.engines.values() if e.serving and e.version != src.version]:
            await c.retire(e)
        for e in [e for e in c.engines.values() if not e.serving and e.version != src.version]:
            e.source = src  # batch engines follow: restarted on the new pool
            if e.running and e.state != S.DRAINING:
                with contextlib.suppress(ControlError):  # (being stopped already)
                    await c.restart(e)
        await self.keep_then_free(src, back=back)
