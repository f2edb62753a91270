"""Starting, watching and stopping engine processes (one process per tp rank).

An engine is a group of rank processes; if one rank dies the whole group is dead
(one_for_all). Exits are reported through `on_exit(engine, incarnation, detail)` the moment
the event loop's child watcher sees them.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import structlog

from holdfast_contract.command import FORKABLE, Placeholders, is_forkable, render
from holdfast_contract.env import EngineEnv, to_environ, var
from holdfast_contract.wire import free_port
from supervisor import vllm_kind
from supervisor.errors import StartupError
from supervisor.fswatch import DirWatch
from supervisor.policy import Policy
from supervisor.procs import Proc
from supervisor.units import Engine, Incarnation

log = structlog.get_logger("supervisor.engines")
ENGINE = [arg.format(python=sys.executable) for arg in FORKABLE]  # what forks serve

ExitFn = Callable[[Engine, Incarnation, str], None]
BeatFn = Callable[[Engine, Incarnation], None]


def wants_forkserver(p: Policy) -> bool:
    """Unless the policy says false: when some engine command is `{python} -m engine ...`."""
    if p.engines.forkserver is False:
        return False
    commands = [p.engines.command, *(b.command for b in p.engines.batch if b.command)]
    return any(is_forkable(c) for c in commands)


class ForkServer:
    """`python -m engine.forkserver` in the run dir: engines fork from it with their imports
    done. Started before the daemons load; restarted when it dies (exec meanwhile)."""

    def __init__(self, run: Path, env: dict[str, str]) -> None:
        self.run = run
        self.sock = run / "forkserver.sock"
        self.env = env
        self.proc: Proc | None = None

    async def start(self) -> None:
        self.sock.unlink(missing_ok=True)  # the run dir is ours alone: a leftover is stale
        argv = [
            sys.executable,
            "-m",
            "engine.forkserver",
            "--socket",
            str(self.sock),
            "--log-format",
            "json",
        ]
        self.proc = await Proc.spawn(argv, self.env, self.run / "logs" / "forkserver.log")

    @property
    def ready(self) -> bool:
        return self.proc is not None and self.proc.alive and self.sock.exists()

    async def wait_ready(self, timeout: float) -> bool:
        """Until it listens (True), it died, or `timeout` passed."""
        if self.proc is None:
            return False
        watch = DirWatch(self.run)
        try:
            seen = asyncio.ensure_future(watch.wait(self.sock.exists, timeout))
            died = asyncio.ensure_future(self.proc.wait())
            await asyncio.wait([seen, died], return_when=asyncio.FIRST_COMPLETED)
            for t in (seen, died):
                t.cancel()
            await asyncio.gather(seen, died, return_exceptions=True)
        finally:
            watch.close()
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
        on_exit: ExitFn,
        on_beat: BeatFn,
        forks: ForkServer | None = None,
    ) -> None:
        self.policy = policy
        self.forks = forks
        self.run = run
        self.model_dir = model_dir
        self.daemons = daemons
        self.on_exit = on_exit
        self.on_beat = on_beat
        self._next_port = policy.engines.port_base
        self.tasks: set[asyncio.Task[None]] = set()

    def _port(self) -> int:
        if not self.policy.engines.port_base:
            return free_port()
        self._next_port += 1
        return self._next_port

    def env(self, e: Engine, rank: int, epoch: int) -> dict[str, str]:
        p = self.policy
        env = {**os.environ, **p.engines.env}
        given = EngineEnv(
            name=e.name,
            role=e.role,
            port=e.port,
            epoch=epoch,
            model=self.model_dir,
            daemons=tuple(self.daemons),
            rank=rank,
            world_size=p.model.tp_size,
            device=p.devices.ids[rank],
            heartbeat_ms=p.heartbeat.interval_ms,
            run=str(self.run),
            dtype=p.model.dtype,
            quantization=p.model.quantization,
        )
        env.update(to_environ(given))
        if e.memory_mb > 0:  # the engine's budget, less a fifth for activations and graphs
            env.setdefault(var("kv_cache_mb"), str(e.memory_mb * 4 // 5))
        env.pop(var("agent"), None)
        if rank == 0 and p.engines.health == "agent":
            env[var("agent")] = f"ipc://{self.run / 'agents'}"
        return env

    def argv(self, e: Engine, env: dict[str, str]) -> list[str]:
        values = Placeholders(
            python=sys.executable,
            name=e.name,
            role=e.role,
            port=env[var("port")],
            epoch=env[var("epoch")],
            model=self.model_dir,
            agent=env.get(var("agent"), ""),
            daemons=env[var("daemons")],
            rank=env[var("rank")],
            world_size=env[var("world_size")],
            device=env[var("device")],
            run=str(self.run),
        )
        return render(e.command, values)

    async def spawn(self, e: Engine, epoch: int) -> Incarnation:
        """Start every rank of `e`; raises StartupError when the command cannot start."""
        e.port = self._port()
        procs: list[Proc] = []
        try:
            for rank in range(self.policy.model.tp_size):
                env = self.env(e, rank, epoch)
                log = self.run / "logs" / f"{e.name}.{rank}.log"
                procs.append(await self._start(self.argv(e, env), env, log))
        except BaseException:
            for p in procs:
                await p.fence()
            raise
        inc = Incarnation(procs)
        self._own(self._watch(e, inc))
        if self.policy.engines.health == "http":
            self._own(self._http_health(e, inc))
        if self.policy.engines.kind == "vllm":
            self._own(vllm_kind.watch_load(e, inc, self.policy))
        return inc

    async def _start(self, argv: list[str], env: dict[str, str], log_path: Path) -> Proc:
        """Fork from the fork server when it serves this command, else exec."""
        forks = self.forks
        if forks is None or argv[:3] != ENGINE:
            return await Proc.spawn(argv, env, log_path)
        if forks.proc is not None and not forks.proc.alive:
            log.warning("fork server exited; restarting it", code=forks.proc.returncode)
            await forks.start()
        if await forks.wait_ready(self.policy.engines.ready_timeout_s / 2):
            try:
                return await Proc.fork(forks.sock, argv, env, log_path)
            except StartupError as err:
                log.warning("fork server did not answer; starting with exec", error=str(err))
        return await Proc.spawn(argv, env, log_path)

    def _own(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _watch(self, e: Engine, inc: Incarnation) -> None:
        waits = [asyncio.ensure_future(p.wait()) for p in inc.procs]
        done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        first = next(iter(done))
        rank = waits.index(first)
        for p in inc.procs:  # one_for_all: the rest of the group goes too, confirmed
            p.kill_group()
        if pending:
            await asyncio.wait(pending, timeout=2.0)
        for w in pending:
            w.cancel()
        detail = f"rank {rank} exited with {first.result()}"
        if not inc.ready:  # it never answered: a start-up failure, its log tail says why
            detail += " during start-up, before it was ready"
        if not inc.handled:
            self.on_exit(e, inc, detail)

    async def _http_health(self, e: Engine, inc: Incarnation) -> None:
        """Heartbeats for engines without the agent: GET /health on their port."""
        interval = self.policy.heartbeat.interval_ms / 1000.0
        timeout = aiohttp.ClientTimeout(total=max(interval, 0.5))
        async with aiohttp.ClientSession(timeout=timeout) as http:
            while not inc.handled and e.inc is inc:
                try:
                    async with http.get(f"http://127.0.0.1:{e.port}/health") as r:
                        if r.status == 200:
                            self.on_beat(e, inc)
                except (aiohttp.ClientError, OSError, TimeoutError):
                    pass
                await asyncio.sleep(interval)

    async def stop(self) -> None:
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
