"""The cache daemons, one per device rank, and the keeper that holds their pools in escrow.

The keeper lives inside the supervisor (torch-free), so a daemon that dies leaves its pool
in escrow; its replacement reclaims it and serves again without reading the checkpoint.
Engines that mapped the pool keep serving meanwhile. Spawning, the exit watch, waiting for
the ready file and owning the tasks are `watcher.Watcher`'s; a daemon's readiness probe is
its ready file (`holdfast_contract.ready`), its health probe the pings of `_probe`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from holdfast_contract.agent_protocol import kv_key
from holdfast_contract.errors import ProtocolError
from holdfast_contract.events import EventName as N
from holdfast_contract.ready import DaemonReady, daemon_ready_path, drop_stale, read_daemon_ready
from supervisor import decisions, pace
from supervisor.backoff import RestartBook
from supervisor.ckptwatch import CheckpointWatch
from supervisor.errors import StartupError
from supervisor.events import EventBus, UnitState
from supervisor.kinds import kind_of
from supervisor.policy import Policy
from supervisor.states import DAEMON, DaemonState, move
from supervisor.units import Daemon, Incarnation
from supervisor.versions import Source, version_of
from supervisor.watcher import Command, Watcher, not_ready, until, until_ready
from supervisor.wiring import ParkedDaemons, Term

if TYPE_CHECKING:  # torch-free, but imported only where they are used
    from cachedaemon.keeper import Keeper
    from cachedaemon.protocol import StatusReply

log = structlog.get_logger("supervisor.daemons")


def daemon_status(sock: str, timeout: float = 2.0) -> StatusReply | None:
    """The daemon's StatusReply (torch-free wire protocol), or None if it does not answer."""
    from cachedaemon import protocol
    from cachedaemon.errors import CacheError

    try:
        reply, _ = protocol.call(sock, protocol.StatusRequest(), timeout=timeout)
    except (CacheError, ProtocolError, OSError):
        return None
    return reply if isinstance(reply, protocol.StatusReply) else None


def _serving(d: Daemon) -> bool:
    return d.state == DaemonState.SERVING


def _gone(d: Daemon) -> bool:
    return d.state in (DaemonState.QUARANTINED, DaemonState.DEAD)


class CacheDaemons:
    def __init__(
        self,
        policy: Policy,
        run: Path,
        model_dir: str,
        bus: EventBus,
        term: Term,
        *,
        generation: int = 1,
        keeper: Keeper | None = None,
    ) -> None:
        """`run`: where its sockets and ready files live (an update's generation n > 1:
        `<run>/gen-<n>`, beside the keeper of the first, `keeper`, which it shares)."""
        self.policy = policy
        self.run = run
        self.model_dir = model_dir
        self.bus = bus
        self.term = term  # the crew's: its epoch, and the wake-up of its loop
        self.generation = generation
        self.keeper: Keeper | None = keeper  # started by start_keeper unless shared
        self.owns_keeper = keeper is None
        self.pace: pace.LoopPace | None = None  # the supervisor's stalls, not a daemon's
        self.keeper_path = (run if keeper is None else keeper.socket_path.parent) / "keeper.sock"
        self.daemons = [
            Daemon(rank=r, device=dev, book=RestartBook(policy.restart))
            for r, dev in enumerate(policy.devices.ids)
        ]
        self.watcher = Watcher()  # every daemon's and spare's exit watch, readiness, pings
        # daemons started ahead, claimed by spawn (a later generation's: update.park)
        self.parked: ParkedDaemons | None = None
        self.stopping = False  # stop_daemons began: no process is started from then on
        self._changed = asyncio.Event()
        self.checkpoint = CheckpointWatch(Path(model_dir), bus, term)

    def all_serving(self) -> bool:
        return all(d.state == DaemonState.SERVING for d in self.daemons)

    def sockets(self) -> list[str]:
        return [str(self.run / f"daemon-{d.rank}.sock") for d in self.daemons]

    def unit(self, d: Daemon) -> str:
        """Rank d's name in events and retained states: `0`, or `0-g2` for generation 2."""
        return str(d.rank) if self.generation == 1 else f"{d.rank}-g{self.generation}"

    @property
    def version(self) -> str:
        """The model version of the pool: rank 0's (every rank holds a shard of the same
        checkpoint); "" until it serves."""
        return self.daemons[0].version if self.daemons else ""

    def source(self) -> Source:
        """Where an engine on these daemons' pool gets its weights."""
        m = self.policy.model
        return Source(
            self.version,
            self.model_dir,
            tuple(self.sockets()),
            m.dtype,
            m.quantization,
            self.generation,
        )

    def start_keeper(self) -> None:
        if self.policy.cache.keeper and self.keeper is None:
            from cachedaemon.keeper import Keeper

            self.keeper = Keeper(self.keeper_path).start()

    async def start(self) -> None:
        """Start every daemon and wait until all serve (cache.ready_timeout_s)."""
        self.start_keeper()
        self.watcher.own(self.checkpoint.run(self.daemons))
        for d in self.daemons:
            await self.spawn(d)
        deadline = time.monotonic() + self.policy.cache.ready_timeout_s
        for d in self.daemons:
            serving = await until(
                functools.partial(_serving, d),
                functools.partial(_gone, d),
                self._changed,
                deadline,
            )
            if not serving:
                raise StartupError(await self._not_serving(d))

    async def _not_serving(self, d: Daemon) -> str:
        """Why rank d does not serve at start: it died (how, when, its last log lines), or
        it is still loading when cache.ready_timeout_s ran out."""
        return await not_ready(
            f"cache daemon rank {d.rank}",
            d.inc,
            self._log(d),
            ("serve", "served"),
            f"cache.ready_timeout_s ({self.policy.cache.ready_timeout_s:g} s); raise it "
            "if loading the checkpoint takes longer",
        )

    def _log(self, d: Daemon, spare: bool = False) -> Path:
        return self.run / "logs" / f"daemon-{d.rank}{'-spare' if spare else ''}.log"

    def command(self, d: Daemon, spare: bool = False) -> Command:
        """How rank d's daemon (or its hot spare) starts."""
        argv = [*self.argv(d), "--spare"] if spare else self.argv(d)
        return Command(argv, dict(os.environ), self._log(d, spare))

    def argv(self, d: Daemon) -> list[str]:
        m = self.policy.model
        python, layout = kind_of(self.policy).daemon_runtime(self.policy)
        argv = [
            python,
            "-m",
            "cachedaemon",
            "--log-format",
            "json",
            "serve",
            "--model",
            self.model_dir,
            "--device",
            d.device,
            "--runtime-dir",
            str(self.run),
            "--tp-size",
            str(m.tp_size),
            "--tp-rank",
            str(d.rank),
            "--dtype",
            m.dtype,
            "--quantization",
            m.quantization,
            "--layout",
            layout,
        ]
        argv += ["--backend", self.policy.cache.backend]
        if self.keeper is not None:
            argv += ["--keeper", str(self.keeper_path)]
        if not self.policy.cache.verify:
            argv.append("--no-verify")
        return argv

    async def spawn(self, d: Daemon) -> None:
        d.spawning = True
        try:
            cmd = self.command(d)
            parked = await self.parked.claim(d, cmd) if self.parked is not None else None
            proc = parked or await Watcher.spawn(cmd)
        finally:
            d.spawning = False
        if self.stopping or d.state != DaemonState.DEAD:  # stopped meanwhile
            await proc.terminate(grace=5.0)
            return
        self.follow(d, Incarnation([proc]))

    def follow(self, d: Daemon, inc: Incarnation, **data: Any) -> None:
        """dead -> starting: follow `inc` (a new process, or the spare that took over)."""
        d.inc = inc
        self._move(d, N.STARTING, **data)
        self.watcher.watch(
            inc, lambda _, code: self.exited(d, inc, code, time.monotonic()), one_for_all=False
        )
        self.watcher.own(self._await_ready(d, inc))

    async def _await_ready(self, d: Daemon, inc: Incarnation) -> None:
        ready = daemon_ready_path(self.run, d.rank)

        def check() -> bool:
            info = read_daemon_ready(ready)
            return (info is not None and info.pid == inc.pid) or inc.handled

        ok = await until_ready(self.run, check, self.policy.cache.ready_timeout_s)
        if not ok or inc.handled or d.inc is not inc:
            return
        info = read_daemon_ready(ready)
        if info is None:  # removed again: the daemon stopped (its exit is handled apart)
            return
        status = await asyncio.to_thread(daemon_status, info.socket)
        if inc.handled or d.inc is not inc:
            return  # it died while it was asked for its status
        d.version = version_of(status) if status is not None else ""
        self.served(d, info, int(getattr(status, "pool_bytes", 0)), time.monotonic())
        self.checkpoint.loaded(d, status)
        self.watcher.own(self._probe(d, inc))
        if self.keeper is not None and self.policy.cache.spare and d.spare is None:
            await self.spawn_spare(d)

    def served(self, d: Daemon, info: DaemonReady, pool_bytes: int, now: float) -> None:
        """starting -> serving: its ready file (`info`) names our process."""
        d.fingerprint = info.fingerprint
        d.adopted = info.adopted
        d.adoptions += int(d.adopted)
        d.pool_bytes = pool_bytes
        ms = (now - d.died_at) * 1000 if d.died_at else None
        self._move(
            d,
            N.SERVING,
            adopted=d.adopted,
            pool_bytes=d.pool_bytes,
            fingerprint=d.fingerprint,
            version=d.version,
            down_ms=ms,
        )
        self.term.wake.set()

    def kv_ident(self, key: str) -> str:
        """Which KV cache the keeper holds under `key` now ("": none, or no keeper)."""
        return self.keeper.kv_ident(key) if self.keeper is not None else ""

    def drop_kv(self, engine: str) -> None:
        """What the keeper holds of `engine`'s shared KV cache (engines.kv_adopt) goes: the
        engine left for good."""
        if self.keeper is not None:
            self.keeper.withdraw_kv(kv_key(engine))

    def before_handout(self, engine: str) -> None:
        """Say so when `engine` is about to start against a pool whose checkpoint changed."""
        self.checkpoint.before_handout(self.daemons, engine)

    async def _probe(self, d: Daemon, inc: Incarnation) -> None:
        """Ping a serving daemon every heartbeat interval; one that leaves its pings
        unanswered (stopped at once; asleep, not run since the first ping it left
        unanswered was written to it, for max(0.5 s, heartbeat.miss_window_s); busy for
        heartbeat.busy_silence_ms, the supervisor's own stalls not counted:
        `decisions.daemon_hung`) is fenced with SIGKILL, so its spare or a restart takes
        over."""
        from cachedaemon import protocol
        from cachedaemon.errors import CacheError

        hb = self.policy.heartbeat
        period = max(0.05, hb.interval_ms / 1000)
        deadline = max(0.5, hb.miss_window_s)
        sock = str(self.run / f"daemon-{d.rank}.sock")
        silent_since: float | None = None  # first unanswered ping of the current run
        runs_then = 0  # how often its threads had been given a CPU at that ping
        while d.inc is inc and not inc.handled:
            await asyncio.sleep(period)
            # when the daemon was asked (its silence counts from there, not from before a
            # connect that a slow supervisor made late), and how often it had run by then
            asked = [(time.monotonic(), pace.runs([inc.pid]))]

            def sent(asked: list[tuple[float, int]] = asked) -> None:
                asked[0] = (time.monotonic(), pace.runs([inc.pid]))

            try:
                await protocol.call_async(sock, protocol.Ping(), timeout=deadline, on_sent=sent)
                silent_since = None
                continue
            except (CacheError, ProtocolError, OSError):
                # a refused or closed connection is what a dying daemon gives: its exit is
                # seen by its exit watch; only silence that lasts is a hang
                if silent_since is None:
                    silent_since, runs_then = asked[0]
            now = time.monotonic()
            if self.pace is not None:
                self.pace.observe(now)  # a stall that ends now counts before the ticker saw it
            why = decisions.daemon_hung(
                now - silent_since,
                self.pace.stalled_s(silent_since, now) if self.pace is not None else 0.0,
                pace.sched_state([inc.pid]),
                pace.runs([inc.pid]) > runs_then,
                deadline,
                hb.busy_silence_ms / 1000,
            )
            if why is not None and d.inc is inc and not inc.handled:
                log.warning("daemon stopped answering; fencing it", rank=d.rank, pid=inc.pid)
                self.bus.emit(
                    "daemon",
                    self.unit(d),
                    N.HUNG,
                    self.term.epoch,
                    pid=inc.pid,
                    silent_ms=round((now - silent_since) * 1000, 1),
                    detail=why,
                )
                await inc.procs[0].fence()
                return

    async def spawn_spare(self, d: Daemon) -> None:
        """A hot spare for rank d: imported and waiting on the serving daemon's pidfd."""
        if self.stopping:
            return
        proc = await Watcher.spawn(self.command(d, spare=True))
        if self.stopping:  # stop_daemons passed this rank while it started: it would take over
            await proc.terminate(grace=5.0)
            return
        inc = Incarnation([proc])
        d.spare = inc
        log.info("spare daemon started", rank=d.rank, pid=inc.pid)
        self.watcher.own(self._watch_spare(d, inc))
        self.watcher.own(self._await_spare_ready(d, inc))

    async def _await_spare_ready(self, d: Daemon, inc: Incarnation) -> None:
        """Publish `daemon.<rank>.spare_ready` once the spare stands by (its .spare file)."""
        spare_file = self.run / f"daemon-{d.rank}.spare"

        def check() -> bool:
            try:
                return bool(json.loads(spare_file.read_text()).get("pid") == inc.pid)
            except (OSError, ValueError):
                return d.spare is not inc

        ok = await until_ready(self.run, check, self.policy.cache.ready_timeout_s)
        if ok and d.spare is inc:
            self.bus.emit("daemon", self.unit(d), N.SPARE_READY, self.term.epoch, pid=inc.pid)

    def _drop_spare_file(self, d: Daemon, inc: Incarnation) -> None:
        """Remove rank d's .spare file once the spare that wrote it (`inc`) has exited; a
        file that names any other process is left alone."""
        spare_file = self.run / f"daemon-{d.rank}.spare"
        try:
            owner = json.loads(spare_file.read_text()).get("pid")
        except (OSError, ValueError, AttributeError):
            return
        if owner == inc.pid and not inc.procs[0].alive:
            spare_file.unlink(missing_ok=True)

    async def _watch_spare(self, d: Daemon, inc: Incarnation) -> None:
        code = await inc.procs[0].wait()
        if d.spare is not inc:
            return  # it took over: its exit is watched as the serving daemon's now
        d.spare = None
        self._drop_spare_file(d, inc)
        log.warning("spare daemon exited", rank=d.rank, exit_code=code, tail=inc.tail(300))
        if d.state == DaemonState.SERVING and not inc.handled:
            await asyncio.sleep(d.book.delay())
            if d.state == DaemonState.SERVING and d.spare is None and not self.stopping:
                await self.spawn_spare(d)

    def exited(self, d: Daemon, inc: Incarnation, code: int | None, now: float) -> None:
        """starting | serving -> dead (restarted after its backoff; at once by its spare,
        when one stands by) or quarantined (restarted too often)."""
        inc.handled = True
        d.died_at = now
        if d.book.record(now):
            self._move(d, N.QUARANTINED, exit_code=code, tail=inc.tail())
            self.term.wake.set()
            return
        d.next_start = now + d.book.delay(now)
        self._move(d, N.DEAD, exit_code=code, tail=inc.tail())
        spare = d.spare
        if spare is not None and spare.procs[0].alive:
            d.spare = None  # the spare is taking over already: follow it
            self.follow(d, spare, spare=True)
        self.term.wake.set()

    def reconcile(self, now: float) -> float | None:
        """Restart dead daemons whose backoff ran out; the next time one is due, or None."""
        due: float | None = None
        for d in self.daemons:
            if d.state != DaemonState.DEAD or d.spawning:
                continue
            if now >= d.next_start:
                d.spawning = True  # until spawn() has its process: no second start
                self.watcher.own(self.spawn(d))
            else:
                due = d.next_start if due is None else min(due, d.next_start)
        return due

    def _move(self, d: Daemon, event: N, **data: Any) -> None:
        """The one way a daemon's state changes: the row of `states.DAEMON` for (its
        state, `event`), published as `daemon.<rank>.<event>`."""
        move(d, DAEMON, event)
        self._changed.set()
        epoch = self.term.epoch
        self.bus.emit("daemon", self.unit(d), event, epoch, pid=d.pid, **data)
        self.bus.state(
            UnitState(
                ts=time.time(),
                kind="daemon",
                name=self.unit(d),
                state=d.state,
                epoch=epoch,
                pid=d.pid,
            )
        )

    async def stop(self) -> None:
        """Every daemon and spare, then the keeper if it is this generation's."""
        await self.stop_daemons()
        if self.keeper is not None and self.owns_keeper:
            self.keeper.close()
            self.keeper = None

    async def stop_daemons(self) -> None:
        """Every daemon and its spare, spares first (a spare left would take over); none
        starts from now on. Then the sockets and ready files a killed one left."""
        self.stopping = True
        for d in self.daemons:
            spare, d.spare = d.spare, None
            if spare is not None:
                spare.handled = True
                await spare.procs[0].terminate(grace=5.0)
                self._drop_spare_file(d, spare)  # killed while it waited: it left its file
            if d.inc is not None:
                d.inc.handled = True
                for p in d.inc.procs:
                    await p.terminate(grace=5.0)
            if d.state != DaemonState.STOPPED:
                self._move(d, N.STOPPED)
        await self.watcher.stop()
        for d in self.daemons:
            drop_stale(self.run / f"daemon-{d.rank}.sock", daemon_ready_path(self.run, d.rank))

    def withdraw(self) -> list[str]:
        """Drop every rank's pool from the keeper's escrow (an update's old or refused
        generation, its daemons stopped): nothing holds it once no engine maps it. The
        fingerprints withdrawn."""
        fps = [d.fingerprint for d in self.daemons if d.fingerprint]
        if self.keeper is not None:
            for fp in fps:
                self.keeper.withdraw(fp)
        return fps
