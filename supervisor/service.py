"""`supervisor run`: bring everything up in order, reconcile until told to stop, tear down.

`Service.run` is one structured block: each part is entered as an async context (or its
cleanup pushed on one `AsyncExitStack`) as it starts, so teardown is start-up's order
reversed, and covers what started, and only that. Order: runtime dir (lock) -> events
(MQTT: refused if another live supervisor holds the prefix) -> agents + control sockets
-> the supervisor's own tasks (`aio.Owned`) -> model (generated from a preset when
model.path is unset) -> the crew over the cache daemons and the launcher, its tasks
(agents, control, pace) -> router + health API (a busy port fails here, before anything
loads) -> MQTT's connection (events queued until then) -> fork server (imports while the
daemons load) -> keeper and daemons (ready) -> engines (the reconcile loop starts them)
-> fleet -> MQTT's birth and retained states, READY=1 -> the reconcile loop (`_loop`).
SIGINT/SIGTERM or `supervisor stop` stop what was started: the router refuses new
requests, the fleet is left, engines, then the fork server and the daemons side by side
(each logged as `part_stopped` with how long it took), HTTP, tasks, sockets. A start
that fails before the broker connection leaves the broker untouched, and its log ends
with `supervisor.main.stopped`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import structlog
import zmq
from aiohttp import web

from holdfast_contract.events import EventName as N
from holdfast_contract.formats import GENERATED_MARK, GENERATION
from supervisor import reconcile, sdnotify
from supervisor.agent_hub import AgentHub
from supervisor.aio import Owned, unless_set
from supervisor.api import HealthApi
from supervisor.control import ControlServer
from supervisor.core import Crew
from supervisor.daemons import CacheDaemons
from supervisor.engines import EngineLauncher, ForkServer
from supervisor.errors import StartupError
from supervisor.events import EventBus
from supervisor.fleet.errors import JoinRefused
from supervisor.fleet.node import FleetView, Node
from supervisor.kinds import kind_of
from supervisor.metrics import SupervisorMetrics
from supervisor.policy import Policy, split_listen
from supervisor.primary import PrimaryView
from supervisor.proxy.router import Router
from supervisor.runtime import RuntimeDir
from supervisor.update.rollout import Rollout
from supervisor.wiring import Term

log = structlog.get_logger("supervisor")
T = TypeVar("T")
# The keeper answers engines from a thread of its own (a promoted standby's ReclaimKV
# among them) while the event loop relays streams: each time it needs the GIL back it
# waits at most this long, not the interpreter's default 5 ms.
SWITCH_INTERVAL_S = 0.0005
B = TypeVar("B", AgentHub, ControlServer)
HTTP_SHUTDOWN_S = 1.0  # the router's and health API's last connections, at the very end


def models_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "holdfast" / "models"


async def ensure_model(policy: Policy) -> str:
    """The checkpoint dir: model.path, or model.preset generated once into the cache."""
    m = policy.model
    if m.path is not None:
        return m.path
    out = models_cache() / f"{m.preset}-seed{m.seed}"
    if generated(out):
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "cachedaemon",
        "make-checkpoint",
        str(tmp),
        "--preset",
        str(m.preset),
        "--seed",
        str(m.seed),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await proc.communicate()
    if proc.returncode != 0:
        raise StartupError(
            f"generating the {m.preset} checkpoint into {out} failed; set "
            f"model.path instead. It printed:\n{output.decode()[-1500:]}"
        )
    if out.exists() and not generated(out):  # an older generation, or one cut short
        stale = out.with_name(f".{out.name}.stale.{os.getpid()}")
        with contextlib.suppress(OSError):
            out.rename(stale)
        shutil.rmtree(stale, ignore_errors=True)  # engines that map it keep their files
    with contextlib.suppress(OSError):
        tmp.rename(out)  # another supervisor may have won the race; both are identical
    shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


def generated(out: Path) -> bool:
    """Whether `out` holds a complete checkpoint of this generation of make-checkpoint."""
    try:
        mark = json.loads((out / GENERATED_MARK).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(mark, dict) and mark.get("generation") == GENERATION


class Service:
    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.stop = asyncio.Event()
        spec = policy.cluster
        self.view = FleetView(spec.node) if spec is not None else PrimaryView()
        self.term = Term()  # the crew's epoch and wake-up, shared with the cache daemons

    async def run(self) -> int:
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stop.set)
        os.umask(0o077)  # every socket and file we create is ours alone
        async with self._events() as (rd, bus), contextlib.AsyncExitStack() as stack:
            try:
                bus.emit(
                    "supervisor",
                    "main",
                    N.STARTING,
                    0,
                    pid=os.getpid(),
                    policy=self.policy.source,
                    run=str(rd.path),
                )
                hub = stack.enter_context(self._bind(rd, "agents", AgentHub))
                control = stack.enter_context(self._bind(rd, "control", ControlServer))
                tasks = await stack.enter_async_context(Owned())
                c = await self._until_stopped(self._start(bus, rd, hub, control, tasks, stack))
                if c is not None:
                    await self._loop(c, tasks)
                return 0
            finally:
                bus.emit("supervisor", "main", N.STOPPING, self.term.epoch)

    @contextlib.asynccontextmanager
    async def _events(self) -> AsyncIterator[tuple[RuntimeDir, EventBus]]:
        """The runtime dir (locked) and the event bus, its MQTT prefix claimed; at the
        end `supervisor.main.stopped`, the bus closed, the dir released."""
        rd = RuntimeDir.acquire(self.policy.cache.runtime_dir)
        try:
            node = self.policy.cluster.node if self.policy.cluster is not None else ""
            bus = EventBus(rd.endpoint("events"), self.policy.events, node)
        except zmq.ZMQError as e:
            rd.release()
            raise StartupError(
                f"cannot listen on {rd.endpoint('events')}: {e}; set cache.runtime_dir"
            ) from e
        try:
            await bus.claim()  # one supervisor per MQTT prefix: refused before any publish
            try:
                yield rd, bus
            finally:
                bus.emit("supervisor", "main", N.STOPPED, self.term.epoch)
        finally:
            await bus.close()
            rd.release()

    async def _until_stopped(self, coro: Coroutine[Any, Any, T]) -> T | None:
        """Run `coro` unless a stop comes first (then cancel it); its result, or None."""
        work = await unless_set(coro, self.stop)
        return None if work is None else work.result()  # re-raises a startup error

    async def _start(
        self,
        bus: EventBus,
        rd: RuntimeDir,
        hub: AgentHub,
        control: ControlServer,
        tasks: Owned,
        stack: contextlib.AsyncExitStack,
    ) -> Crew:
        """Build the crew over the cache daemons and the launcher; serve; start the fork
        server and the daemons and wait until they serve. Each part that needs stopping
        goes on `stack` as it starts."""
        p = self.policy
        model_dir = await ensure_model(p)
        forks_spec = kind_of(p).forks(p)
        forks = (
            ForkServer(rd.path, {**os.environ, **p.engines.env}, forks_spec)
            if forks_spec is not None
            else None
        )
        daemons = CacheDaemons(p, rd.path, model_dir, bus, self.term)
        launcher = EngineLauncher(p, rd.path, model_dir, daemons.sockets(), forks=forks)
        c = Crew(p, bus, self.view, self.term, hub=hub, launcher=launcher, daemons=daemons)
        daemons.pace = c.pace  # its stalls are no daemon's silence
        rollout = Rollout(c, daemons, launcher)  # `supervisor update`
        tasks.start(c.pace.run(), "pace")
        node = (
            Node(p.cluster, p.api.listen, bus, c, self.view)
            if p.cluster is not None and isinstance(self.view, FleetView)
            else None
        )
        tasks.start(hub.serve(c), "agents")
        tasks.start(
            control.serve(functools.partial(reconcile.handle, c, stop=self.stop, rollout=rollout)),
            "control",
        )
        router = await self._listen(c, hub, control, node, stack)
        bus.start()  # the broker hears from a supervisor that could listen
        t0 = time.monotonic()
        await stack.enter_async_context(_children(forks, daemons, rollout.stop_daemons))
        launcher.source = daemons.source()  # the version is known once they serve
        c.version = launcher.source.version
        bus.emit(
            "supervisor",
            "main",
            N.DAEMONS_READY,
            c.epoch,
            ms=round((time.monotonic() - t0) * 1000, 1),
        )
        await rollout.gens.parked.start(daemons.daemons)  # update.park: the next pool's daemons
        stack.push_async_callback(_stop_engines, c, launcher)
        stack.push_async_callback(rollout.close)  # before the engines stop
        if node is not None:  # joins now; campaigns once the crew can serve
            tasks.start(node.run(daemons.daemons[0].fingerprint), "fleet")
            # leave the cluster first (the lease is revoked): another node takes over at once
            stack.push_async_callback(tasks.stop, "fleet")
        stack.callback(router.stop)  # new requests: 503 now; those under way go on
        bus.emit(
            "supervisor",
            "main",
            N.STARTED,
            c.epoch,
            router=p.router.listen,
            api=p.api.listen,
        )
        bus.go_live()  # MQTT's birth and retained states: only a started supervisor's
        sdnotify.ready(f"daemons serve; router {p.router.listen}")
        # what start-up built lives as long as the supervisor: out of the collector's
        # sight, a full collection no longer walks it in the middle of a promotion
        gc.freeze()
        return c

    @contextlib.contextmanager
    def _bind(self, rd: RuntimeDir, name: str, make: Callable[[str], B]) -> Iterator[B]:
        """The socket `make` binds at `ipc://<run>/<name>`, closed at the end."""
        try:
            sock = make(rd.endpoint(name))
        except zmq.ZMQError as e:
            raise StartupError(
                f"cannot listen in {rd.path}: {e}; set cache.runtime_dir to another dir"
            ) from e
        try:
            yield sock
        finally:
            sock.close()

    async def _listen(
        self,
        c: Crew,
        hub: AgentHub,
        control: ControlServer,
        node: Node | None,
        stack: contextlib.AsyncExitStack,
    ) -> Router:
        """Serve the router and the health API."""
        spec = self.policy.cluster
        name, shape = spec.node if spec else "", kind_of(self.policy).stream
        router = Router(
            self.policy.router,
            self.view,
            name,
            c.bus.emit,
            shape,
            kv_keys=self.policy.engines.kv_adopt,
        )
        # a client that hangs up cancels its routed request, so the engine stops generating
        await self._serve_http(router.app(), "router.listen", stack, cancel_on_hangup=True)
        metrics = SupervisorMetrics(c.bus, router=router, agents=hub, control=control)
        await self._serve_http(HealthApi(c.snapshot, metrics, node).app(), "api.listen", stack)
        return router

    async def _serve_http(
        self,
        app: web.Application,
        key: str,
        stack: contextlib.AsyncExitStack,
        cancel_on_hangup: bool = False,
    ) -> None:
        """Serve `app` on the policy's `key` (router.listen or api.listen)."""
        listen = self.policy.router.listen if key == "router.listen" else self.policy.api.listen
        host, port = split_listen(listen)
        # by cleanup the engines are stopped and the router refuses new requests: a request
        # that arrives as the listener closes is not waited for (aiohttp's default is 60 s)
        runner = web.AppRunner(
            app,
            access_log=None,
            handler_cancellation=cancel_on_hangup,
            shutdown_timeout=HTTP_SHUTDOWN_S,
        )
        await runner.setup()
        stack.push_async_callback(runner.cleanup)
        try:
            await web.TCPSite(runner, host, port, reuse_address=True).start()
        except OSError as e:
            why = os.strerror(e.errno) if e.errno else str(e)
            raise StartupError(
                f"cannot listen on {listen} ({key}): {why.lower()}; change {key} in the policy"
            ) from e

    async def _loop(self, c: Crew, tasks: Owned) -> None:
        interval = self.policy.heartbeat.interval_ms / 1000.0
        stop = asyncio.ensure_future(self.stop.wait())
        failed = asyncio.ensure_future(tasks.failed.wait())
        try:
            while not self.stop.is_set():
                c.wake.clear()
                due = await reconcile.tick(c)
                left = interval if due is None else max(0.0, min(interval, due - time.monotonic()))
                wake = asyncio.ensure_future(c.wake.wait())
                await asyncio.wait(
                    [wake, stop, failed], timeout=left, return_when=asyncio.FIRST_COMPLETED
                )
                wake.cancel()
                _raise_failure(tasks)
        finally:
            stop.cancel()
            failed.cancel()


def _raise_failure(tasks: Owned) -> None:
    """Raise the first failure of the supervisor's own tasks: a fleet's refusal as it was
    worded, any other as the StartupError that names the task."""
    if not tasks.failures:
        return
    name, exc = tasks.failures[0]
    if isinstance(exc, JoinRefused):
        raise exc
    raise StartupError(f"supervisor task {name} failed") from exc


@contextlib.asynccontextmanager
async def _children(
    forks: ForkServer | None,
    daemons: CacheDaemons,
    stop_daemons: Callable[[], Awaitable[None]],
) -> AsyncIterator[None]:
    """The fork server (it imports while the daemons load), then the keeper and daemons,
    serving; at the end, those started go down side by side (each may use its SIGTERM
    grace), each logged as it is down, so a slow one is named. `stop_daemons` stops every
    generation of them (supervisor/update/generations.py), the first's keeper last."""
    started: list[tuple[str, Callable[[], Awaitable[None]]]] = []
    try:
        if forks is not None:
            await forks.start()
            started.append(("forkserver", forks.stop))
        started.append(("daemons", stop_daemons))  # from now on there are daemons to stop
        await daemons.start()
        yield
    finally:
        await asyncio.gather(*[_stopped(part, stop) for part, stop in started])


async def _stop_engines(c: Crew, launcher: EngineLauncher) -> None:
    await c.stop_all()
    await launcher.stop()


async def _stopped(part: str, stop: Callable[[], Awaitable[None]]) -> None:
    """Run `stop`, then log how long `part` took to stop."""
    t0 = time.monotonic()
    await stop()
    log.info("part_stopped", part=part, ms=round((time.monotonic() - t0) * 1000, 1))
