"""The cache daemons of each model version: the first generation, which `supervisor run`
starts and which owns the keeper, and one more per update, each with its own sockets,
ready files and logs under `<run>/gen-<n>/`, depositing its pool with the same keeper
(escrow is keyed by the pool's fingerprint, so two versions never meet there). A
generation that is no longer served is stopped and its pool withdrawn from escrow: once
no engine maps it, its memory is freed."""

from __future__ import annotations

import msgspec
import structlog

from supervisor.daemons import CacheDaemons
from supervisor.policy import Policy
from supervisor.update.parked import Parked

log = structlog.get_logger("supervisor.update")


class Generations:
    """Every generation of cache daemons that runs; the first one owns the keeper."""

    def __init__(self, first: CacheDaemons) -> None:
        self.first = first
        self.live: list[CacheDaemons] = [first]
        self._made = 1
        self.parked = Parked(first.policy, first.run, first.watcher)  # for the next ones

    def make(self, model_dir: str, dtype: str, quantization: str) -> CacheDaemons:
        """The next generation, for `model_dir` held as `dtype` / `quantization`; not started."""
        self._made += 1
        first, n = self.first, self._made
        run = first.run / f"gen-{n}"
        (run / "logs").mkdir(parents=True, mode=0o700, exist_ok=True)
        p = first.policy
        model = msgspec.structs.replace(
            p.model, path=model_dir, dtype=dtype, quantization=quantization
        )
        policy: Policy = msgspec.structs.replace(p, model=model)
        gen = CacheDaemons(
            policy, run, model_dir, first.bus, first.term, generation=n, keeper=first.keeper
        )
        gen.pace = first.pace
        gen.parked = self.parked
        self.live.append(gen)
        return gen

    async def free(self, gen: CacheDaemons) -> list[str]:
        """Stop `gen`'s daemons and spares and withdraw its pool from escrow (the keeper
        stays: the first generation owns it); the fingerprints withdrawn."""
        await gen.stop_daemons()
        fps = gen.withdraw()
        if gen in self.live:
            self.live.remove(gen)
        log.info("pool freed", generation=gen.generation, fingerprints=fps)
        return fps

    async def stop(self) -> None:
        """The supervisor stops: the parked daemons, every later generation, then the
        first and its keeper."""
        await self.parked.stop()
        for gen in reversed(self.live[1:]):
            await gen.stop_daemons()
        await self.first.stop()
