"""The fork server's spares: after forking an engine, the server forks a spare from the same
request (holdfast_fork/server.py); it warms up (`Spares.warm`) and waits, and the next
request with the same `Spares.key` is handed to it (the reference engine's: engine.spare).

`Shelf` is the server's side: one spare per device, warming or warm, its pidfd and socket
on the server's selector. `wait_for_claim` is the spare's side, run in the fork: warm up,
say so (`W` and the phases, or `F` and why not), and wait for the claim (`_CLAIM`, then the
request's fds and frame).
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import socket
import struct
import threading
from collections.abc import Callable
from typing import NamedTuple

import msgspec
import structlog

from holdfast_contract import wire
from holdfast_contract.errors import HoldfastError
from holdfast_contract.forkserver import MAX_FRAME, Spawn, decode_spawn, frame
from holdfast_fork.errors import ForkError
from holdfast_fork.forking import die_with, fork_running

log = structlog.get_logger("holdfast_fork")

_CLAIM = struct.Struct(">dd")  # a spare's claim: the request's arrival, the spare's warm-up ms

Key = tuple[str, ...]  # what a spare depends on, its device first
# run a claimed request in this process, as the server runs one it forks:
# (spawn, its fds, its clock's start, the spare's warm-up ms) -> exit status
Become = Callable[[Spawn, list[int], float, float], int]


class Spares(NamedTuple):
    """What an engine kind's spares are made of: `key`, what a spare made from a request
    depends on (a request with the same key may take it; None: no spare for it), and
    `warm`, run in the spare before it is claimed (ms by phase, "total" among them)."""

    key: Callable[[Spawn], Key | None]
    warm: Callable[[Spawn], dict[str, float]]


def _no_key(spawn: Spawn) -> None:
    return None


def _no_warm(spawn: Spawn) -> dict[str, float]:
    raise ForkError("this fork server makes no spares")


NO_SPARES = Spares(_no_key, _no_warm)


class _Spare:
    """A forked spare as the server sees it: warming up, or warm and waiting on `sock` for
    the request that claims it."""

    def __init__(self, pid: int, pidfd: int, sock: socket.socket, key: Key) -> None:
        self.pid, self.pidfd, self.sock, self.key = pid, pidfd, sock, key
        self.warm_ms: float | None = None  # set when it says it is warm


class Shelf:
    """The server's spares, made by `make`, one per device; their pidfds and sockets are
    registered on the server's selector `sel`."""

    def __init__(self, sel: selectors.BaseSelector, make: Spares) -> None:
        self.sel = sel
        self.make = make
        self.by_device: dict[str, _Spare] = {}  # device -> its one spare
        self.by_fd: dict[int, _Spare] = {}  # its pidfd and its socket's fd -> spare

    def key(self, spawn: Spawn) -> Key | None:
        return self.make.key(spawn)

    def wanted(self, key: Key) -> bool:
        """Whether a spare is to be made for `key` (after its request was served): none
        stands for its device yet."""
        return key[0] not in self.by_device

    def claim(
        self, key: Key | None, spawn: Spawn, fds: list[int], arrived: float
    ) -> tuple[int, int] | None:
        """Hand `spawn` to the warm spare made for `key`: (pid, pidfd), or None to fork.
        A spare of the same device made for another key is dropped."""
        if key is None:
            return None
        s = self.by_device.get(key[0])
        if s is not None and s.key != key:
            self.drop(s, "another request's settings")
            return None
        if s is None or s.warm_ms is None:  # none, or still warming: this one forks
            return None
        del self.by_device[key[0]], self.by_fd[s.sock.fileno()], self.by_fd[s.pidfd]
        self.sel.unregister(s.sock)
        try:
            socket.send_fds(s.sock, [_CLAIM.pack(arrived, s.warm_ms)], fds)
            s.sock.sendall(frame(spawn))
        except OSError as e:  # it died as it was claimed
            log.warning("spare lost", pid=s.pid, error=str(e))
            self.drop(s, "")
            return None
        s.sock.close()
        log.info("engine from a spare", pid=s.pid, warm_ms=round(s.warm_ms, 1))
        return s.pid, s.pidfd

    def fork(self, key: Key, in_spare: Callable[[socket.socket], int]) -> None:
        """Fork a spare for `key`; it runs `in_spare` on its end of the socket to this."""
        mine, theirs = socket.socketpair()

        def run() -> int:
            mine.close()
            return in_spare(theirs)

        pid = fork_running(run)
        theirs.close()
        s = _Spare(pid, os.pidfd_open(pid), mine, key)
        self.by_device[key[0]] = s
        self.by_fd[s.pidfd] = self.by_fd[mine.fileno()] = s
        self.sel.register(s.pidfd, selectors.EVENT_READ)
        self.sel.register(mine, selectors.EVENT_READ)
        log.info("spare forked", pid=pid, device=key[0])

    def event(self, fd: int) -> None:
        """A spare said it is warm (or why it is not), or exited unclaimed."""
        s = self.by_fd[fd]
        if fd == s.pidfd:
            self.drop(s, "exited")
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
            self.drop(s, said[1:].decode(errors="replace") or "closed its socket")

    def drop(self, s: _Spare, why: str) -> None:
        """Kill and reap `s` (reaping waits at most for a SIGKILL to land)."""
        if self.by_device.get(s.key[0]) is s:
            del self.by_device[s.key[0]]
        for fd in (s.pidfd, s.sock.fileno()):
            if self.by_fd.pop(fd, None) is not None:
                self.sel.unregister(fd)
        with contextlib.suppress(ProcessLookupError):
            os.kill(s.pid, signal.SIGKILL)
        os.waitpid(s.pid, 0)
        os.close(s.pidfd)
        s.sock.close()
        if why:
            log.warning("spare dropped", pid=s.pid, reason=why)

    def close(self) -> None:
        """Drop every spare."""
        for s in list(self.by_device.values()):
            self.drop(s, "")

    def close_fds(self) -> None:
        """In a fork: close the server's fds of its spares (they run on)."""
        for s in self.by_device.values():
            os.close(s.pidfd)
            s.sock.close()


def wait_for_claim(
    template: Spawn, sock: socket.socket, server: int, make: Spares, become: Become
) -> int:
    """In a spare, detached from the fork server `server`: warm up for `template`, say so,
    wait for a claim, then be its engine (`become`). It dies with the server until
    claimed; after, with the claim's owner."""
    claimed = threading.Event()
    die_with(server, unless=claimed)
    os.environ.clear()
    os.environ.update(template.env)  # CUDA starts in the environment engines get
    try:
        phases = make.warm(template)
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
    return become(decode_spawn(body), fds, arrived, warm_ms)
