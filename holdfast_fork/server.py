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
handed to it (the reference engine's: engine.spare).
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import msgspec
import structlog

from holdfast_contract import wire
from holdfast_contract.errors import HoldfastError, ProtocolError
from holdfast_contract.forkserver import (
    MAX_FRAME,
    Exited,
    Refused,
    Spawn,
    Started,
    decode_spawn,
    frame,
)
from holdfast_fork.errors import ForkError
from holdfast_fork.forking import die_with, fork_running
from holdfast_fork.listener import Request

log = structlog.get_logger("holdfast_fork")

_CLAIM = struct.Struct(">dd")  # a spare's claim: the request's arrival, the spare's warm-up ms

# what a fork runs once it has its fds, environment and directory: (flags, clock, spare ms)
# -> exit status: engine.forkserver's runs `python -m engine`, holdfast_vllm.forkserver's
# vLLM's API server
Program = Callable[[list[str], float, float], int]


class Spares(NamedTuple):
    """What an engine kind's spares are made of: `key`, what a spare made from a request
    depends on (a request with the same key may take it; None: no spare for it), and
    `warm`, run in the spare before it is claimed (ms by phase, "total" among them)."""

    key: Callable[[Spawn], tuple[str, ...] | None]
    warm: Callable[[Spawn], dict[str, float]]


def _no_key(spawn: Spawn) -> None:
    return None


def _no_warm(spawn: Spawn) -> dict[str, float]:
    raise ForkError("this fork server makes no spares")


NO_SPARES = Spares(_no_key, _no_warm)


class _Spare:
    """A forked spare (`Spares`) as the server sees it: warming up, or warm and waiting
    on `sock` for the request that claims it."""

    def __init__(self, pid: int, pidfd: int, sock: socket.socket, key: tuple[str, ...]) -> None:
        self.pid, self.pidfd, self.sock, self.key = pid, pidfd, sock, key
        self.warm_ms: float | None = None  # set when it says it is warm


class Server:
    def __init__(
        self, listener: socket.socket, program: Program, spares: Spares = NO_SPARES
    ) -> None:
        self.listener = listener
        self.program = program
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
        self.make_spares = spares
        self.spares: dict[str, _Spare] = {}  # device -> its one spare
        self.spare_fds: dict[int, _Spare] = {}  # its pidfd and its socket's fd -> spare

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
                elif key.fd in self.spare_fds:
                    self._spare_event(key.fd)
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
            key = self.make_spares.key(spawn)
            claimed = self._claim(key, spawn, fds, arrived)
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
        if key is not None and key[0] not in self.spares:
            self._fork_spare(spawn, key)

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

    # ---- spares (Spares) ----
    def _claim(
        self, key: tuple[str, ...] | None, spawn: Spawn, fds: list[int], arrived: float
    ) -> tuple[int, int] | None:
        """Hand `spawn` to the warm spare made for `key`: (pid, pidfd), or None to fork.
        A spare of the same device made for another key is dropped."""
        if key is None:
            return None
        s = self.spares.get(key[0])
        if s is not None and s.key != key:
            self._drop_spare(s, "another request's settings")
            return None
        if s is None or s.warm_ms is None:  # none, or still warming: this one forks
            return None
        del self.spares[key[0]], self.spare_fds[s.sock.fileno()], self.spare_fds[s.pidfd]
        self.sel.unregister(s.sock)
        try:
            socket.send_fds(s.sock, [_CLAIM.pack(arrived, s.warm_ms)], fds)
            s.sock.sendall(frame(spawn))
        except OSError as e:  # it died as it was claimed
            log.warning("spare lost", pid=s.pid, error=str(e))
            self._drop_spare(s, "")
            return None
        s.sock.close()
        log.info("engine from a spare", pid=s.pid, warm_ms=round(s.warm_ms, 1))
        return s.pid, s.pidfd

    def _fork_spare(self, spawn: Spawn, key: tuple[str, ...]) -> None:
        mine, theirs = socket.socketpair()

        def in_spare() -> int:
            mine.close()
            return self._spare(spawn, theirs)

        pid = fork_running(in_spare)
        theirs.close()
        s = _Spare(pid, os.pidfd_open(pid), mine, key)
        self.spares[key[0]] = s
        self.spare_fds[s.pidfd] = self.spare_fds[mine.fileno()] = s
        self.sel.register(s.pidfd, selectors.EVENT_READ)
        self.sel.register(mine, selectors.EVENT_READ)
        log.info("spare forked", pid=pid, device=key[0])

    def _spare_event(self, fd: int) -> None:
        """A spare said it is warm (or why it is not), or exited unclaimed."""
        s = self.spare_fds[fd]
        if fd == s.pidfd:
            self._drop_spare(s, "exited")
            return
        try:
            said = s.sock.recv(512)
        except OSError:
            said = b""
        if said.startswith(b"W"):
            phases = msgspec.json.decode(said[1:], type=dict[str, float])
            s.warm_ms = phases["total"]
            log.info("spare warm", pid=s.pid, warm_ms=s.warm_ms, phases=phases)
        else:
            self._drop_spare(s, said[1:].decode(errors="replace") or "closed its socket")

    def _drop_spare(self, s: _Spare, why: str) -> None:
        """Kill and reap `s` (reaping waits at most for a SIGKILL to land)."""
        if self.spares.get(s.key[0]) is s:
            del self.spares[s.key[0]]
        for fd in (s.pidfd, s.sock.fileno()):
            if self.spare_fds.pop(fd, None) is not None:
                self.sel.unregister(fd)
        with contextlib.suppress(ProcessLookupError):
            os.kill(s.pid, signal.SIGKILL)
        os.waitpid(s.pid, 0)
        os.close(s.pidfd)
        s.sock.close()
        if why:
            log.warning("spare dropped", pid=s.pid, reason=why)

    def close_spares(self) -> None:
        for s in list(self.spares.values()):
            self._drop_spare(s, "")

    def _spare(self, template: Spawn, sock: socket.socket) -> int:
        """In a spare: warm up for `template`, say so, wait for a claim, then be its engine.
        It dies with the server until claimed; after, with the claim's owner."""
        server = os.getppid()
        self._detach()
        claimed = threading.Event()
        die_with(server, unless=claimed)
        os.environ.clear()
        os.environ.update(template.env)  # CUDA starts in the environment engines get
        try:
            phases = self.make_spares.warm(template)
        except (HoldfastError, OSError, RuntimeError, ValueError) as e:
            with contextlib.suppress(OSError):
                sock.sendall(b"F" + f"{type(e).__name__}: {e}".encode()[:500])
            return 1
        sock.sendall(b"W" + msgspec.json.encode(phases))
        data, fds, _, _ = socket.recv_fds(sock, _CLAIM.size, 3)
        if not data:
            return 0  # dropped, or the server is gone
        data += wire.recv_exact(sock, _CLAIM.size - len(data), "spare's claim")
        arrived, warm_ms = _CLAIM.unpack(data)
        body, _ = wire.recv_frame(sock, max_frame=MAX_FRAME, what="claimed request")
        claimed.set()
        sock.close()
        return self._become(decode_spawn(body), fds, arrived, spare_ms=warm_ms)

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
        for s in self.spares.values():
            os.close(s.pidfd)
            s.sock.close()

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
