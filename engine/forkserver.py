"""A fork server for engines: one process pays for the imports, each engine is a fork.

The requests and replies, and the client that sends them, are `holdfast_contract.forkserver`.
`python -m engine.forkserver --socket PATH` imports everything an engine imports (torch,
aiohttp, the model code; never CUDA), then listens. Each `Spawn` request carries the engine's
flags, environment and working directory, with its stdin/stdout/stderr as file descriptors
(SCM_RIGHTS). The server forks; the child starts a session of its own, takes those fds, and
runs `python -m engine` from the flags on, with the startup clock started at the fork. The
server answers `Started(pid)` at once and `Exited(code)` when it reaps the child.

Engines outlive the fork server: a child watches the pid named in `Spawn.owner` (the
supervisor) through a pidfd and kills itself when that process is gone, so neither a crash
of the fork server nor one of the supervisor leaves an engine behind or takes one down early.
This module imports without torch; only `serve` loads it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import selectors
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

import msgspec

from cachedaemon import protocol
from cachedaemon.errors import ProtocolError
from cachedaemon.rundir import listen, socket_answers
from engine.errors import EngineError
from holdfast_contract.forkserver import (
    MAX_FRAME,
    Exited,
    Refused,
    Spawn,
    Started,
    decode_spawn,
    frame,
)

PRELOAD = ("engine.app", "engine.model", "engine.runner", "engine.weights", "engine.hf")


# ---- server ----
def bind(path: Path) -> socket.socket:
    """Listen on `path`: refused if a server answers there, a dead one's socket replaced."""
    if socket_answers(path):
        raise EngineError(f"a fork server already listens on {path}")
    path.unlink(missing_ok=True)  # left by one that died
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    staging.unlink(missing_ok=True)
    listener = listen(staging, backlog=64)
    os.rename(staging, path)  # the path appears only once it accepts connections
    return listener


class Server:
    def __init__(self, listener: socket.socket) -> None:
        self.listener = listener
        self.sel = selectors.DefaultSelector()
        self.sel.register(listener, selectors.EVENT_READ)
        self.children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, conn)

    def loop(self) -> None:
        while True:
            for key, _ in self.sel.select():
                if key.fileobj is self.listener:
                    self._accept()
                else:
                    self._reap(int(key.fd))

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        if protocol.peer_uid(conn) != os.getuid():
            conn.close()  # another user
            return
        conn.settimeout(5.0)
        fds: list[int] = []
        try:
            body, fds = protocol.recv_frame(conn, max_fds=3, max_frame=MAX_FRAME)
            spawn = decode_spawn(body)
            if len(fds) != 3:
                raise EngineError(f"send stdin, stdout and stderr as 3 fds, not {len(fds)}")
            pid = self._fork(spawn, fds, conn)
            conn.sendall(frame(Started(pid)))
        except (OSError, EOFError, EngineError, ProtocolError, msgspec.MsgspecError) as e:
            with contextlib.suppress(OSError):
                conn.sendall(frame(Refused(str(e))))
            conn.close()
            return
        finally:
            for fd in fds:
                os.close(fd)
        pidfd = os.pidfd_open(pid)
        self.children[pidfd] = (pid, conn)
        self.sel.register(pidfd, selectors.EVENT_READ)

    def _reap(self, pidfd: int) -> None:
        pid, conn = self.children.pop(pidfd)
        self.sel.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        with contextlib.suppress(OSError):  # a client that is gone has nobody to tell
            conn.sendall(frame(Exited(os.waitstatus_to_exitcode(status))))
        conn.close()

    def _fork(self, spawn: Spawn, fds: list[int], conn: socket.socket) -> int:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid:
            return pid
        code = 1
        try:
            conn.close()  # the server's end: its EOF tells the client the server died
            code = self._child(spawn, fds)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    def _child(self, spawn: Spawn, fds: list[int]) -> int:
        t0 = time.perf_counter()
        os.setsid()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        self.sel.close()
        self.listener.close()
        for pidfd, (_, conn) in self.children.items():
            os.close(pidfd)
            conn.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.environ.clear()
        os.environ.update(spawn.env)
        os.chdir(spawn.cwd)
        sys.argv = [sys.executable, "-m", "engine", *spawn.argv]
        if spawn.owner:
            die_with(spawn.owner)
        from engine.cli import main

        try:
            return main(spawn.argv, t0=t0)
        except SystemExit as e:  # argparse: --help, or a usage error
            return e.code if isinstance(e.code, int) else 2


def die_with(pid: int) -> None:
    """SIGKILL this process the moment `pid` exits (or now, if it already has)."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        os.kill(os.getpid(), signal.SIGKILL)
        return

    def watch() -> None:
        sel = selectors.DefaultSelector()
        sel.register(pidfd, selectors.EVENT_READ)
        sel.select()
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="die-with-owner", daemon=True).start()


def preload() -> float:
    """Import what an engine imports; seconds taken. CUDA must stay uninitialized."""
    import importlib

    t0 = time.perf_counter()
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError as e:  # engine.hf needs the `hf` extra; engines import it lazily
            if name != "engine.hf":
                raise EngineError(f"cannot preload {name}: {e}") from e
    import torch

    from engine import fused, paged_decode

    if paged_decode.triton_ready():  # loading Triton's library holds the GIL 0.1-0.3 s: here,
        paged_decode._kernel()  # not in an engine whose heartbeats would stall; defining
        fused._kernels()  # kernels touches no GPU
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        raise EngineError("CUDA was initialized while preloading; forks could not use it")
    return time.perf_counter() - t0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m engine.forkserver",
        description="Import the engine once; fork a ready-to-run engine per request.",
        epilog="example:\n  python -m engine.forkserver --socket /tmp/run/forkserver.sock",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--socket", required=True, type=Path, help="unix socket to listen on")
    p.add_argument("--log-format", choices=["console", "json"], default="console")
    args = p.parse_args(argv)
    from holdfast_contract import logs

    logs.setup(args.log_format)
    import structlog

    log = structlog.get_logger("engine.forkserver")
    try:
        seconds = preload()
        server = Server(bind(args.socket))
    except EngineError as e:
        print(f"engine.forkserver: error: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    log.info("forkserver ready", socket=str(args.socket), preload_s=round(seconds, 3))
    try:
        server.loop()
    finally:
        args.socket.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
