"""`supervisor run`: bring everything up in order, reconcile until told to stop, tear down.

Order (`run`, then `_start`): runtime dir (lock) -> events (MQTT: refused if another live
supervisor holds the prefix) -> model (generated from a preset when model.path is unset)
-> agents + control sockets, router + health API (a busy port fails here, before anything
loads) -> MQTT's connection (events queued until then) -> fork server (imports while the
daemons load) -> keeper and daemons (ready) -> MQTT's birth and retained states, READY=1
-> engines via the reconcile loop (`_loop`). SIGINT/SIGTERM or `supervisor stop` stop
what was started, and only that: engines, then the fork server and the daemons side by
side (each logged as `part_stopped` with how long it took), keeper, sockets. A start
that fails before the broker connection leaves the broker untouched, and its log ends
with `supervisor.main.stopped`.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import structlog
import zmq
from aiohttp import web

from holdfast_contract.control import ControlReply, Request
from holdfast_contract.formats import GENERATED_MARK, GENERATION
from supervisor import reconcile, sdnotify
from supervisor.agent_hub import AgentHub
from supervisor.aio import cancel_all
from supervisor.api import HealthApi
from supervisor.control import ControlServer
from supervisor.core import Cluster
from supervisor.daemons import DaemonPool
from supervisor.engines import EngineLauncher, ForkServer
from supervisor.errors import StartupError
from supervisor.events import EventBus
from supervisor.fleet.errors import JoinRefused
from supervisor.fleet.node import FleetView, Node
from supervisor.kinds import kind_of
from supervisor.metrics import SupervisorMetrics
from supervisor.policy import Policy, split_listen
from supervisor.router import PrimaryView, Router
from supervisor.runtime import RuntimeDir
from supervisor.wiring import Inbox

log = structlog.get_logger("supervisor")
T = TypeVar("T")
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
        self.node: Node | None = None  # this node in its cluster, with a `cluster:` section
        self._tasks: list[asyncio.Task[Any]] = []
        self._runners: list[web.AppRunner] = []
        # what `_start` has built so far, torn down by `_teardown` whatever got built
        self.forks: ForkServer | None = None
        self.hub: AgentHub | None = None
        self.daemons: DaemonPool | None = None
        self.launcher: EngineLauncher | None = None
        self.cluster: Cluster | None = None
        self._control_server: ControlServer | None = None
        self.router: Router | None = None

    def _own(self, coro: Coroutine[Any, Any, Any], name: str) -> None:
        self._tasks.append(asyncio.get_running_loop().create_task(coro, name=name))

    @property
    def epoch(self) -> int:
        return self.cluster.epoch if self.cluster is not None else 0

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stop.set)
        os.umask(0o077)  # every socket and file we create is ours alone
        rd = RuntimeDir.acquire(self.policy.cache.runtime_dir)
        try:
            node = self.policy.cluster.node if self.policy.cluster is not None else ""
            bus = EventBus(rd.endpoint("events"), self.policy.events, node)
        except zmq.ZMQError as e:
            rd.release()
            raise StartupError(
                f"cannot listen on {rd.endpoint('events')}: {e}; set cache.runtime_dir"
            ) from e
        try:  # one supervisor per MQTT prefix: refused before anything is published
            await bus.claim()
        except StartupError:
            await bus.close()
            rd.release()
            raise
        try:
            if await self._until_stopped(self._start(bus, rd)) and self.cluster is not None:
                await self._loop(self.cluster)
            return 0
        finally:
            bus.emit("supervisor", "main", "stopping", self.epoch)
            await self._teardown()
            bus.emit("supervisor", "main", "stopped", self.epoch)
            await bus.close()
            rd.release()

    async def _until_stopped(self, coro: Coroutine[Any, Any, None]) -> bool:
        """Run `coro` unless a stop comes first (then cancel it); True if it finished."""
        work = asyncio.ensure_future(coro)
        stop = asyncio.ensure_future(self.stop.wait())
        try:
            await asyncio.wait([work, stop], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
            return False
        work.result()  # re-raise a startup error
        return True

    async def _start(self, bus: EventBus, rd: RuntimeDir) -> None:
        """Build the parts (agents socket, daemon pool, launcher), then the cluster over
        them; listen; start the daemons and wait until they serve."""
        bus.emit(
            "supervisor",
            "main",
            "starting",
            0,
            pid=os.getpid(),
            policy=self.policy.source,
            run=str(rd.path),
        )
        model_dir = await ensure_model(self.policy)
        inbox = Inbox()  # the hub, launcher and daemons report to the cluster built last
        self.hub = hub = self._bind(
            rd,
            lambda: AgentHub(
                rd.endpoint("agents"),
                on_hello=inbox.hello,
                on_heartbeat=inbox.heartbeat,
                on_state=inbox.state,
                on_ack=inbox.ack,
            ),
        )
        forks = kind_of(self.policy).forks(self.policy)
        if forks is not None:
            env = {**os.environ, **self.policy.engines.env}
            self.forks = ForkServer(rd.path, env, forks)
        daemons = DaemonPool(
            self.policy, rd.path, model_dir, bus, kick=inbox.kick, epoch=inbox.epoch
        )
        self.launcher = launcher = EngineLauncher(
            self.policy,
            rd.path,
            model_dir,
            daemons.sockets(),
            on_exit=inbox.exit,
            reports=inbox,
            forks=self.forks,
        )
        self.cluster = c = Cluster(
            self.policy, bus, self.view, hub=hub, launcher=launcher, daemons=daemons
        )
        inbox.attach(c)
        daemons.pace = c.pace  # its stalls are no daemon's silence
        self._own(c.pace.run(), "pace")
        if self.policy.cluster is not None and isinstance(self.view, FleetView):
            self.node = Node(self.policy.cluster, self.policy.api.listen, bus, c, self.view)
        await self._listen(c, rd, hub)
        bus.start()  # the broker hears from a supervisor that could listen
        if self.forks is not None:
            await self.forks.start()  # imports while the daemons load
        t0 = time.monotonic()
        self.daemons = daemons  # from now on there are daemons to stop
        await daemons.start()
        bus.emit(
            "supervisor",
            "main",
            "daemons-ready",
            c.epoch,
            ms=round((time.monotonic() - t0) * 1000, 1),
        )
        if self.node is not None:  # joins now; campaigns once the pool can serve
            self._own(self.node.run(daemons.daemons[0].fingerprint), "fleet")
        bus.emit(
            "supervisor",
            "main",
            "started",
            c.epoch,
            router=self.policy.router.listen,
            api=self.policy.api.listen,
        )
        bus.go_live()  # MQTT's birth and retained states: only a started supervisor's
        sdnotify.ready(f"daemons serve; router {self.policy.router.listen}")
        # what start-up built lives as long as the supervisor: out of the collector's
        # sight, a full collection no longer walks it in the middle of a promotion
        gc.freeze()

    def _bind(self, rd: RuntimeDir, make: Callable[[], T]) -> T:
        try:
            return make()
        except zmq.ZMQError as e:
            raise StartupError(
                f"cannot listen in {rd.path}: {e}; set cache.runtime_dir to another dir"
            ) from e

    async def _listen(self, c: Cluster, rd: RuntimeDir, hub: AgentHub) -> None:
        """Serve the agents and control sockets, the router and the health API."""
        self._own(hub.serve(), "agents")
        control = self._bind(
            rd, lambda: ControlServer(rd.endpoint("control"), lambda r: self._control(c, r))
        )
        self._control_server = control
        self._own(control.serve(), "control")
        spec = self.policy.cluster
        node, shape = spec.node if spec else "", kind_of(self.policy).stream
        router = Router(self.policy.router, self.view, node, c.bus.emit, shape)
        self.router = router
        # a client that hangs up cancels its routed request, so the engine stops generating
        await self._serve_http(router.app(), "router.listen", cancel_on_hangup=True)
        metrics = SupervisorMetrics(c.bus, router=router, agents=hub, control=control)
        await self._serve_http(HealthApi(c.snapshot, metrics, self.node).app(), "api.listen")

    async def _control(self, c: Cluster, req: Request) -> ControlReply:
        return await reconcile.handle(c, req, self.stop)

    async def _serve_http(
        self, app: web.Application, key: str, cancel_on_hangup: bool = False
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
        self._runners.append(runner)
        try:
            await web.TCPSite(runner, host, port, reuse_address=True).start()
        except OSError as e:
            why = os.strerror(e.errno) if e.errno else str(e)
            raise StartupError(
                f"cannot listen on {listen} ({key}): {why.lower()}; change {key} in the policy"
            ) from e

    async def _loop(self, c: Cluster) -> None:
        interval = self.policy.heartbeat.interval_ms / 1000.0
        stop = asyncio.ensure_future(self.stop.wait())
        try:
            while not self.stop.is_set():
                c.wake.clear()
                due = await reconcile.tick(c)
                left = interval if due is None else max(0.0, min(interval, due - time.monotonic()))
                wake = asyncio.ensure_future(c.wake.wait())
                await asyncio.wait([wake, stop], timeout=left, return_when=asyncio.FIRST_COMPLETED)
                wake.cancel()
                self._check_tasks()
        finally:
            stop.cancel()

    def _check_tasks(self) -> None:
        for t in self._tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                if isinstance(t.exception(), JoinRefused):
                    raise t.exception()  # type: ignore[misc]  # the refusal, as it was worded
                raise StartupError(f"supervisor task {t.get_name()} failed") from t.exception()

    def _parts_to_stop(self) -> list[tuple[str, Callable[[], Coroutine[Any, Any, None]]]]:
        parts: list[tuple[str, Callable[[], Coroutine[Any, Any, None]]]] = []
        if self.forks is not None and self.forks.proc is not None:
            parts.append(("forkserver", self.forks.stop))
        if self.daemons is not None:
            parts.append(("daemons", self.daemons.stop))
        return parts

    async def _teardown(self) -> None:
        if self.router is not None:  # new requests: 503 now; those under way go on
            self.router.stop()
        # leave the cluster first (the lease is revoked): another node takes over at once
        await cancel_all([t for t in self._tasks if t.get_name() == "fleet"])
        if self.cluster is not None:
            await self.cluster.stop_all()
        if self.launcher is not None:
            await self.launcher.stop()
        # the fork server and the daemons go down side by side (each may use its SIGTERM
        # grace), each logged as it is down, so a slow one is named
        await asyncio.gather(*[_stopped(part, stop) for part, stop in self._parts_to_stop()])
        for runner in self._runners:
            await runner.cleanup()
        await cancel_all(self._tasks)
        if self.hub is not None:
            self.hub.close()
        if self._control_server is not None:
            self._control_server.close()


async def _stopped(part: str, stop: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run `stop`, then log how long `part` took to stop."""
    t0 = time.monotonic()
    await stop()
    log.info("part_stopped", part=part, ms=round((time.monotonic() - t0) * 1000, 1))
