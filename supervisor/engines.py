"""Starting, watching and stopping engine processes (one process per tp rank).

An engine is a group of rank processes; if one rank dies the whole group is dead
(one_for_all). Exits are reported to the `into` given to `spawn` (`into.on_exit(engine,
incarnation, detail)`) the moment the event loop's child watcher sees them. Spawning, the exit watch and owning the tasks are
`watcher.Watcher`'s; the start command is the engine kind's, rendered per rank here; its
probes (readiness, health, the kind's own) are its `kinds.Kind.probes`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import structlog

from holdfast_contract.command import Placeholders, render
from holdfast_contract.env import EngineEnv, to_environ, var
from holdfast_contract.wire import free_port
from supervisor.errors import StartupError
from supervisor.kinds import Forks, kind_of
from supervisor.policy import Policy
from supervisor.procs import Proc
from supervisor.units import Engine, Incarnation
from supervisor.versions import Source
from supervisor.watcher import Command, Watcher, until_ready
from supervisor.wiring import Reports

log = structlog.get_logger("supervisor.engines")


class ForkServer:
    """A kind's fork server (`kinds.Forks`) in the run dir: engines fork from it
    with their imports done. Started before the daemons load; restarted when it dies
    (exec meanwhile)."""

    def __init__(self, run: Path, env: dict[str, str], forks: Forks) -> None:
        self.run = run
        self.forks = forks
        self.sock = run / f"{forks.name}.sock"
        self.env = env
        self.proc: Proc | None = None

    def serves(self, argv: list[str]) -> bool:
        return argv[: len(self.forks.serves)] == self.forks.serves

    async def start(self) -> None:
        self.sock.unlink(missing_ok=True)  # the run dir is ours alone: a leftover is stale
        argv = [*self.forks.server, "--socket", str(self.sock), "--log-format", "json"]
        self.proc = await Watcher.spawn(
            Command(argv, self.env, self.run / "logs" / f"{self.forks.name}.log")
        )

    @property
    def ready(self) -> bool:
        return self.proc is not None and self.proc.alive and self.sock.exists()

    async def wait_ready(self, timeout: float) -> bool:
        """Until it listens (True), it died, or `timeout` passed."""
        if self.proc is None:
            return False
        await until_ready(self.run, self.sock.exists, timeout, unless=self.proc)
        return self.ready

    async def stop(self) -> None:
        if self.proc is not None:
            await self.proc.terminate(grace=2.0)


class EngineLauncher:
    def __init__(
        self,
        policy: Policy,
        run: Path,
        model_dir: str,
        daemons: list[str],
        forks: ForkServer | None = None,
    ) -> None:
        self.policy = policy
        self.forks = forks
        self.run = run
        m = policy.model
        # the pool an engine starts on unless it names its own (`Engine.source`): the
        # cache daemons' that serve now; its version is known once they serve
        self.source = Source("", model_dir, tuple(daemons), m.dtype, m.quantization)
        self._next_port = policy.engines.port_base
        self.watcher = Watcher()  # every exit watch and probe of every engine
        self.probes = kind_of(policy).probes(policy)  # readiness, health, the kind's own

    def _port(self) -> int:
        if not self.policy.engines.port_base:
            return free_port()
        self._next_port += 1
        return self._next_port

    def env(self, e: Engine, rank: int, epoch: int) -> dict[str, str]:
        p, src = self.policy, e.source or self.source
        env = {**os.environ, **p.engines.env}
        given = EngineEnv(
            name=e.name,
            role=e.role,
            port=e.port,
            epoch=epoch,
            model=src.model_dir,
            daemons=src.daemons,
            rank=rank,
            world_size=p.model.tp_size,
            device=p.devices.ids[rank],
            heartbeat_ms=p.heartbeat.interval_ms,
            run=str(self.run),
            dtype=src.dtype,
            quantization=src.quantization,
        )
        env.update(to_environ(given))
        if e.memory_mb > 0:  # the engine's budget, less a fifth for activations and graphs
            env.setdefault(var("kv_cache_mb"), str(e.memory_mb * 4 // 5))
        env.pop(var("kv_share"), None)
        if p.engines.kv_adopt and e.serving:  # its KV cache kept in the keeper
            env[var("kv_share")] = str(self.run / "keeper.sock")
        env.pop(var("agent"), None)
        if rank == 0 and p.engines.health == "agent":
            env[var("agent")] = f"ipc://{self.run / 'agents'}"
        return env

    def command(self, e: Engine, rank: int, epoch: int) -> Command:
        """How rank `rank` of `e` starts: the engine kind's command (`e.command`, which
        kind resolved into the policy) rendered for it."""
        env = self.env(e, rank, epoch)
        return Command(self.argv(e, env), env, self.run / "logs" / f"{e.name}.{rank}.log")

    def argv(self, e: Engine, env: dict[str, str]) -> list[str]:
        values = Placeholders(
            python=sys.executable,
            name=e.name,
            role=e.role,
            port=env[var("port")],
            epoch=env[var("epoch")],
            model=env[var("model")],
            agent=env.get(var("agent"), ""),
            daemons=env[var("daemons")],
            rank=env[var("rank")],
            world_size=env[var("world_size")],
            device=env[var("device")],
            run=str(self.run),
        )
        return render(e.command, values)

    async def spawn(self, e: Engine, epoch: int, into: Reports) -> Incarnation:
        """Start every rank of `e`; its exit and its health probes' beats are reported to
        `into`. Raises StartupError when the command cannot start."""
        e.port = self._port()
        if e.source is None:
            e.source = self.source
        procs: list[Proc] = []
        try:
            for rank in range(self.policy.model.tp_size):
                procs.append(await self._start(self.command(e, rank, epoch)))
        except BaseException:
            for p in procs:
                await p.fence()
            raise
        inc = Incarnation(procs)
        self.watcher.watch(
            inc, lambda rank, code: into.on_exit(e, inc, _exit_detail(inc, rank, code))
        )
        for probe in self.probes:
            self.watcher.own(probe(e, inc, self.policy, into))
        return inc

    async def _start(self, cmd: Command) -> Proc:
        """Fork from the fork server when it serves this command, else exec."""
        forks = self.forks
        if forks is None or not forks.serves(cmd.argv):
            return await Watcher.spawn(cmd)
        if forks.proc is not None and not forks.proc.alive:
            log.warning("fork server exited; restarting it", code=forks.proc.returncode)
            await forks.start()
        if await forks.wait_ready(self.policy.engines.ready_timeout_s / 2):
            try:
                return await Watcher.fork(forks.sock, cmd)
            except StartupError as err:
                log.warning("fork server did not answer; starting with exec", error=str(err))
        return await Watcher.spawn(cmd)

    async def stop(self) -> None:
        await self.watcher.stop()


def _exit_detail(inc: Incarnation, rank: int, code: int | None) -> str:
    detail = f"rank {rank} exited with {code}"
    if not inc.ready:  # it never answered: a start-up failure, its log tail says why
        detail += " during start-up, before it was ready"
    return detail
