"""The cache daemon: load (or reclaim) one rank's pool, then serve it as fds."""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import structlog

import cachedaemon.protocol as protocol
from cachedaemon.backends import Backend, get_backend
from cachedaemon.config import CacheConfig, LoadOptions, checkpoint_changes, checkpoint_identity
from cachedaemon.digest import differences
from cachedaemon.errors import CheckpointError, DaemonUnavailable
from cachedaemon.frameserver import FrameServer, Reply
from cachedaemon.pool import Pool, build_pool
from cachedaemon.rundir import claim, listen, prepare, read_owner, write_json_atomic
from holdfast_contract import wire
from holdfast_contract.errors import ProtocolError
from holdfast_contract.ready import DaemonReady, daemon_ready_path, is_alive, start_time

log = structlog.get_logger("cachedaemon.daemon")


class DaemonOptions(msgspec.Struct, frozen=True):
    load: LoadOptions = LoadOptions()  # what this rank's pool is made of
    model: str = ""
    runtime_dir: str = ""
    keeper: str | None = None
    verify: str = "before"  # before | background | off: checksums of a reclaimed pool
    spare: bool = False  # wait for the rank's serving daemon to exit, then take over
    read_timeout: float = 5.0


VERIFY_MODES = ("before", "background", "off")


def reclaim(keeper: str, config: CacheConfig, backend: Backend, verify: bool) -> Pool | None:
    """The keeper's pool for this config, checked; None when there is none or it is bad."""
    fp = config.fingerprint()
    try:
        reply, fds = protocol.call(keeper, protocol.Reclaim(fp), max_fds=wire.MAX_FDS)
    except (DaemonUnavailable, ProtocolError, OSError) as exc:
        log.warning("keeper unavailable; loading from disk", keeper=keeper, error=str(exc))
        return None
    if not isinstance(reply, protocol.Reclaimed):
        return None
    manifest = reply.manifest
    pool = Pool(
        manifest,
        [backend.open(fd, c.size) for fd, c in zip(fds, manifest.chunks, strict=True)],
        fds,
    )
    bad = pool.bad_tensors(backend) if verify else []
    if bad:
        log.error(
            "keeper pool failed checksums; reloading from disk",
            tensors=bad[:5],
            count=len(bad),
        )
        pool.close()
        protocol.call(keeper, protocol.Withdraw(fp))
        return None
    return pool


def deposit(keeper: str, pool: Pool) -> None:
    try:
        reply, _ = protocol.call(keeper, protocol.Deposit(pool.manifest), pool.fds)
        if not isinstance(reply, protocol.Ok):
            log.warning("keeper refused the deposit", reply=repr(reply))
    except (DaemonUnavailable, ProtocolError, OSError) as exc:
        log.warning("deposit failed; this pool dies with the daemon", error=str(exc))


def builder(layout: str) -> Callable[..., tuple[Pool, int]]:
    """What builds a pool of `layout`: holdfast's loader, or vLLM's model and loaders
    (imported only here: a reclaimed pool of either layout needs no vLLM)."""
    if layout != "vllm":
        return build_pool
    from holdfast_vllm.layout import build_pool as build_vllm_pool

    return build_vllm_pool


class CacheServer:
    """One cache daemon's serving side: its pool, its socket, its clients (the
    supervisor's record of a daemon is `supervisor.units.Daemon`)."""

    def __init__(self, opts: DaemonOptions, config: CacheConfig) -> None:
        self.opts = opts
        self.config = config
        self.fingerprint = config.fingerprint()
        self.run_dir = prepare(opts.runtime_dir)
        self.socket_path = self.run_dir / f"daemon-{opts.load.tp_rank}.sock"
        self.ready_path = daemon_ready_path(self.run_dir, opts.load.tp_rank)
        self.spare_path = self.run_dir / f"daemon-{opts.load.tp_rank}.spare"
        self.backend = get_backend(config.backend, opts.load.device)
        self.pool: Pool | None = None
        self.adopted = False
        self.load_seconds = 0.0
        self.bytes_read = 0
        self.attaches = 0
        self._server: FrameServer | None = None
        self._done = threading.Event()
        self.exit_code = 0

    def wait_to_take_over(self) -> None:
        """A spare: everything imported and checked (a GPU backend has made its context
        already), wait (pidfd) until the daemon that serves this rank exits, then go on to
        reclaim its pool from the keeper."""
        while True:
            owner = read_owner(self.ready_path) or {}
            pid, started = owner.get("pid"), owner.get("start_time")
            started = started if isinstance(started, int) else None
            if not isinstance(pid, int) or pid == os.getpid() or not is_alive(pid, started):
                return
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                return
            try:
                if is_alive(pid, started):  # still the same process, not a reused pid
                    write_json_atomic(self.spare_path, {"pid": os.getpid(), "serving_pid": pid})
                    log.info("spare waiting", serving_pid=pid)
                    select.select([fd], [], [])
            finally:
                os.close(fd)
                self._drop_spare_file()
            log.info("spare taking over", dead_pid=pid)

    def _drop_spare_file(self) -> None:
        owner = read_owner(self.spare_path) or {}
        if owner.get("pid") == os.getpid():
            self.spare_path.unlink(missing_ok=True)

    def load(self) -> None:
        if self.opts.spare:
            self.wait_to_take_over()
        claim(self.socket_path, self.ready_path, f"rank {self.opts.load.tp_rank} in {self.run_dir}")
        t0 = time.perf_counter()
        if self.opts.keeper:
            before = self.opts.verify == "before"
            self.pool = reclaim(self.opts.keeper, self.config, self.backend, before)
            self.adopted = self.pool is not None
        if self.pool is None:
            from cachedaemon.progress import ByteProgress

            build = builder(self.opts.load.layout)
            with ByteProgress(f"loading {Path(self.opts.model).name}") as progress:
                self.pool, self.bytes_read = build(
                    self.opts.model, self.opts.load, self.backend, self.fingerprint, progress
                )
            self._check_unchanged()
            if self.opts.keeper:
                deposit(self.opts.keeper, self.pool)
        self.load_seconds = time.perf_counter() - t0
        log.info(
            "pool ready",
            adopted=self.adopted,
            seconds=round(self.load_seconds, 3),
            checkpoint_bytes_read=self.bytes_read,
        )

    def _check_unchanged(self) -> None:
        """The files as stat sees them now are those the load began with: a file written
        while it was read would leave a pool of neither checkpoint under the old identity."""
        now = msgspec.structs.replace(
            self.config, checkpoint=checkpoint_identity(Path(self.opts.model))
        )
        changed = checkpoint_changes(now, self.config)
        if changed and self.pool is not None:
            self.pool.close()
            self.pool = None
            raise CheckpointError(
                f"{self.opts.model} changed while it was loaded ({'; '.join(changed)}); "
                "serve it again once it is written whole"
            )

    def serve(self) -> None:
        sock = listen(self.socket_path)
        self._server = FrameServer(sock, self._handle, read_timeout=self.opts.read_timeout)
        self._server.start()
        ready = DaemonReady(
            pid=os.getpid(),
            start_time=start_time(os.getpid()),
            socket=str(self.socket_path),
            fingerprint=self.fingerprint,
            adopted=self.adopted,
        )
        write_json_atomic(self.ready_path, msgspec.to_builtins(ready))
        log.info("serving", socket=str(self.socket_path), fingerprint=self.fingerprint)
        if self.adopted and self.opts.verify == "background":
            threading.Thread(target=self._verify_in_background, daemon=True).start()

    def _verify_in_background(self) -> None:
        """Check a reclaimed pool while already serving it. On a mismatch: withdraw it
        from the keeper and exit non-zero, so that the restart loads from disk."""
        pool, keeper = self.pool, self.opts.keeper
        if pool is None or keeper is None:
            return
        t0 = time.perf_counter()
        bad = pool.bad_tensors(self.backend)
        ms = round((time.perf_counter() - t0) * 1e3, 3)
        if not bad:
            log.info("reclaimed pool verified", ms=ms, tensors=len(pool.manifest.tensors))
            return
        log.error(
            "reclaimed pool failed checksums while serving; withdrawing it and exiting "
            "so that a restart reloads from disk",
            tensors=bad[:5],
            count=len(bad),
        )
        protocol.call(keeper, protocol.Withdraw(self.fingerprint))
        self.exit_code = 3
        self._done.set()

    def wait(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self._done.set())
        self._done.wait()

    def close(self) -> None:
        self._drop_spare_file()
        for p in (self.socket_path, self.ready_path):  # first: a kill may follow soon
            p.unlink(missing_ok=True)
        if self._server is not None:
            self._server.close()
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def _handle(self, msg: protocol._Msg, fds: list[int]) -> Reply:
        wire.close_fds(fds)
        pool = self.pool
        if pool is None:
            return protocol.ErrorReply("the daemon is not serving yet"), []
        if isinstance(msg, protocol.Ping):
            return protocol.Pong(os.getpid(), self.fingerprint), []
        if isinstance(msg, protocol.AttachRequest):
            refused = self._refusal(msg, pool)
            if refused is not None:
                return refused, []
            self.attaches += 1
            return protocol.AttachReply(pool.manifest), pool.fds
        if isinstance(msg, protocol.StatusRequest):
            return self._status(pool), []
        return protocol.ErrorReply(f"the daemon does not answer {type(msg).__name__}"), []

    def _refusal(self, msg: protocol.AttachRequest, pool: Pool) -> protocol.Mismatch | None:
        """None when the engine's config is the pool's, or differs only in the files'
        stat facts and the engine's digest of its files equals the pool's."""
        if msg.config is None or msg.config == self.config:
            return None
        fields = msg.config.diff(self.config)
        files = pool.manifest.files
        if fields == ["checkpoint"] and msg.content:
            differ = differences(msg.content, files) if files else ["the pool has no digest"]
            if not differ:
                log.info("attach by content: the engine's files hold the pool's bytes")
                return None
            log.warning("attach refused: checkpoint content differs", files=differ)
        else:
            log.warning("attach refused: config mismatch", fields=fields)
        return protocol.Mismatch(fields, self.config, files)

    def _status(self, pool: Pool) -> protocol.StatusReply:
        m = pool.manifest
        return protocol.StatusReply(
            pid=os.getpid(),
            fingerprint=self.fingerprint,
            backend=m.backend,
            device=m.device,
            pool_bytes=m.pool_bytes,
            chunks=len(m.chunks),
            tensors=len(m.tensors),
            clients_attached=self.attaches,
            clients_connected=self._server.connected if self._server else 0,
            adopted=self.adopted,
            load_seconds=self.load_seconds,
            config=self.config,
            files=m.files,
        )


def run(opts: DaemonOptions, config: CacheConfig) -> int:
    daemon = CacheServer(opts, config)
    try:
        daemon.load()
        daemon.serve()
        daemon.wait()
    finally:
        daemon.close()
    return daemon.exit_code
