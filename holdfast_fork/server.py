"""The fork server: one process has imported an engine's code, each engine is a fork of it.

Each `Spawn` request (holdfast_contract.forkserver) carries the engine's flags, environment
and working directory, with its stdin/stdout/stderr as file descriptors (SCM_RIGHTS). The
server forks; the child starts a session of its own, takes those fds, and runs the server's
`Program` with the flags, its startup clock started at the fork. The server answers
`Started(pid)` at once and `Exited(code)` when it reaps the child.

Engines outlive the fork server: a child watches the pid named in `Spawn.owner` (the
supervisor) through a pidfd and kills itself when that process is gone, so neither a crash
of the fork server nor one of the supervisor leaves an engine behind or takes one down early.

With `Spares`, after forking an engine the server forks a spare from the same request: it
warms up (`Spares.warm`) and waits, and the next request with the same `Spares.key` is
handed to it (the reference engine's: engine.spare); holdfast_fork/spares.py keeps them.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import socket
import time
from collections.abc import Callable

import msgspec
import structlog

from holdfast_contract import wire
from holdfast_contract.errors import HoldfastError, ProtocolError
from holdfast_contract.forkserver import Exited, Refused, Spawn, Started, decode_spawn, frame
from holdfast_fork.errors import ForkError
from holdfast_fork.forking import die_with, fork_running
from holdfast_fork.listener import Request
from holdfast_fork.spares import NO_SPARES, Key, Shelf, Spares, wait_for_claim

log = structlog.get_logger("holdfast_fork")

# what a fork runs once it has its fds, environment and directory: (flags, clock, spare ms)
# -> exit status: engine.forkserver's runs `python -m engine`, holdfast_vllm.forkserver's
# vLLM's API server
Program = Callable[[list[str], float, float], int]


class Server:
    def __init__(
        self,
        listener: socket.socket,
        program: Program,
        spares: Spares = NO_SPARES,
        after: Callable[[Spawn], None] | None = None,
    ) -> None:
        """`after`: run here, in the server, once a request is answered (its engine forked
        or a spare handed over, and the next spare forked): what it leaves in this process
        (a file read, never a device touched) every later fork inherits."""
        self.listener = listener
        self.program = program
        self.after = after
        self.sel = selectors.DefaultSelector()
        self.sel.register(listener, selectors.EVENT_READ)
        # a signal (SIGTERM: stop) may be delivered to any thread of the process, and an
        # imported library (vLLM) starts some: its byte on this socket wakes the select, so
        # the main thread runs the handler at once, not at the next request
        self.wake_r, self.wake_w = socket.socketpair()
        self.wake_w.setblocking(False)
        self.wake_r.setblocking(False)
        signal.set_wakeup_fd(self.wake_w.fileno(), warn_on_full_buffer=False)
        self.sel.register(self.wake_r, selectors.EVENT_READ)
        self.children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, conn)
        self.requests: dict[int, Request] = {}  # conn fd -> its request, still arriving
        self.spares = Shelf(self.sel, spares)

    def loop(self) -> None:
        while True:
            due = min((r.deadline for r in self.requests.values()), default=None)
            wait = None if due is None else max(0.0, due - time.monotonic())
            for key, _ in self.sel.select(wait):
                if key.fileobj is self.listener:
                    self._accept()
                elif key.fileobj is self.wake_r:
                    with contextlib.suppress(BlockingIOError):
                        self.wake_r.recv(512)  # the handler runs once select has returned
                elif key.fd in self.children:
                    self._reap(key.fd)
                elif key.fd in self.spares.by_fd:
                    self.spares.event(key.fd)
                elif key.fd in self.requests:
                    self._read(self.requests[key.fd])
            now = time.monotonic()
            for req in [r for r in self.requests.values() if r.deadline <= now]:
                self._refuse(req, "timed out waiting for a frame")

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError as e:  # a peer gone before it was accepted, or no fd left for it
            log.warning("accept failed", error=str(e))
            return
        try:
            uid: int | None = wire.peer_uid(conn)
        except OSError:
            uid = None
        refusal = ""
        if uid != os.getuid():  # another user: its request is read, then refused with why
            refusal = (
                f"peer uid {uid} is not this fork server's uid {os.getuid()}; connect as that user"
            )
        conn.setblocking(False)
        self.requests[conn.fileno()] = Request(conn, refusal)
        self.sel.register(conn, selectors.EVENT_READ)

    def _read(self, req: Request) -> None:
        try:
            body = req.feed()
        except (OSError, EOFError, ProtocolError) as e:
            self._refuse(req, str(e))
            return
        if body is None:
            return
        if req.refusal:  # read first, so the peer's write never meets a closed socket
            self._refuse(req, req.refusal)
            return
        arrived = time.perf_counter()
        self._done_reading(req)
        conn, fds = req.conn, req.fds
        conn.settimeout(5.0)
        try:
            spawn = decode_spawn(body)
            if len(fds) != 3:
                raise ForkError(f"send stdin, stdout and stderr as 3 fds, not {len(fds)}")
            key = self.spares.key(spawn)
            claimed = self.spares.claim(key, spawn, fds, arrived)
            if claimed is None:
                pid = self._fork(spawn, fds, conn)
                pidfd = os.pidfd_open(pid)
                self.sel.register(pidfd, selectors.EVENT_READ)
            else:
                pid, pidfd = claimed  # its pidfd is registered already
        except (OSError, HoldfastError, msgspec.MsgspecError) as e:
            with contextlib.suppress(OSError):
                conn.sendall(frame(Refused(str(e))))
            conn.close()
            return
        finally:
            wire.close_fds(fds)
            fds.clear()
        self.children[pidfd] = (pid, conn)
        with contextlib.suppress(OSError):  # a client gone already: its engine runs on
            conn.sendall(frame(Started(pid)))
        if key is not None and self.spares.wanted(key):
            self._fork_spare(spawn, key)
        if self.after is not None:
            try:
                self.after(spawn)
            except Exception as e:  # only what later forks find done: they do it themselves
                log.warning("after a fork", error=f"{type(e).__name__}: {e}")

    def _done_reading(self, req: Request) -> None:
        self.sel.unregister(req.conn)
        del self.requests[req.conn.fileno()]

    def _refuse(self, req: Request, why: str) -> None:
        self._done_reading(req)
        with contextlib.suppress(OSError):
            req.conn.sendall(frame(Refused(why)))
        req.close()

    def _reap(self, pidfd: int) -> None:
        pid, conn = self.children.pop(pidfd)
        self.sel.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        with contextlib.suppress(OSError):  # a client that is gone has nobody to tell
            conn.sendall(frame(Exited(os.waitstatus_to_exitcode(status))))
        conn.close()

    # ---- spares (holdfast_fork/spares.py) ----
    def _fork_spare(self, spawn: Spawn, key: Key) -> None:
        def in_spare(sock: socket.socket) -> int:
            server = os.getppid()
            self._detach()
            return wait_for_claim(spawn, sock, server, self.spares.make, self._become)

        self.spares.fork(key, in_spare)

    def close_spares(self) -> None:
        self.spares.close()

    # ---- in a fork ----
    def _fork(self, spawn: Spawn, fds: list[int], conn: socket.socket) -> int:
        def in_fork() -> int:
            conn.close()  # the server's end: its EOF tells the client the server died
            t0 = time.perf_counter()
            self._detach()
            return self._become(spawn, fds, t0)

        return fork_running(in_fork)

    def _detach(self) -> None:
        """A session of its own, default signals, none of the server's fds."""
        os.setsid()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        self.sel.close()
        self.listener.close()
        self.wake_r.close()
        self.wake_w.close()
        for pidfd, (_, conn) in self.children.items():
            os.close(pidfd)
            conn.close()
        for req in self.requests.values():  # other peers' requests, still arriving
            req.close()
        self.spares.close_fds()

    def _become(self, spawn: Spawn, fds: list[int], t0: float, spare_ms: float = 0.0) -> int:
        """Run the program `spawn` asks for, on its fds, its clock started at `t0`."""
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        wire.close_fds([fd for fd in fds if fd > 2])
        os.environ.clear()
        os.environ.update(spawn.env)
        os.chdir(spawn.cwd)
        if spawn.owner:
            die_with(spawn.owner)
        return self.program(spawn.argv, t0, spare_ms)
