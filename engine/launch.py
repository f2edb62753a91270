"""Start `python -m engine` as a child process and wait for its "ready" line (no torch here).

Used by the startup benchmark and the tests: the child logs JSON lines on stderr, a thread
reads them, and waiters block on events with deadlines instead of polling the port.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from engine.errors import EngineError
from holdfast_contract import forkserver as fs
from holdfast_contract.errors import ForkServerError
from holdfast_contract.wire import free_port

REPO = Path(__file__).resolve().parent.parent


class ForkedChild:
    """The part of Popen that EngineProcess uses, for an engine forked by a fork server:
    its exit code comes as `Exited` on the request's connection."""

    def __init__(self, sock: socket.socket, pid: int) -> None:
        self.sock, self.pid = sock, pid
        self.returncode: int | None = None
        self._lock = threading.Lock()

    @classmethod
    def start(
        cls, server: Path, flags: list[str], env: dict[str, str]
    ) -> tuple[ForkedChild, IO[str]]:
        """Fork an engine with `flags`; (the child, a stream of its stderr)."""
        r, w = os.pipe()
        null_in, null_out = os.open(os.devnull, os.O_RDONLY), os.open(os.devnull, os.O_WRONLY)
        spawn = fs.Spawn(argv=flags, env=env, cwd=os.getcwd(), owner=os.getpid())
        try:
            sock, pid = fs.request(server, spawn, [null_in, null_out, w])
        except ForkServerError as e:
            os.close(r)
            raise EngineError(str(e)) from e
        except BaseException:
            os.close(r)
            raise
        finally:
            for fd in (w, null_in, null_out):
                os.close(fd)
        return cls(sock, pid), os.fdopen(r, "r")

    def _read_exit(self, timeout: float | None) -> None:
        """Take the `Exited` reply if it comes within `timeout` (None: wait for it)."""
        lost = EngineError(f"engine {self.pid}: fork server gone, exit unknown")
        if self.sock.fileno() < 0:
            raise lost
        if not select.select([self.sock], [], [], timeout)[0]:
            raise subprocess.TimeoutExpired(f"engine {self.pid}", timeout or 0.0)
        self.sock.settimeout(5.0)  # readable: the frame is there, or EOF
        try:
            reply = fs.read_reply(self.sock)
        except ForkServerError as e:
            self.sock.close()
            raise lost from e
        if isinstance(reply, fs.Exited):
            self.returncode = reply.code
            self.sock.close()

    def poll(self) -> int | None:
        if self.returncode is None and self._lock.acquire(blocking=False):
            try:
                if self.returncode is None and self.sock.fileno() >= 0:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        self._read_exit(0)
            finally:
                self._lock.release()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self._lock:
            if self.returncode is None:
                self._read_exit(timeout)
        assert self.returncode is not None
        return self.returncode

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)


class EngineProcess:
    """One engine child; `ready` is its parsed "ready" log line once it serves."""

    def __init__(
        self,
        args: Sequence[str],
        env: Mapping[str, str] | None = None,
        port: int | None = None,
        forkserver: Path | None = None,
    ) -> None:
        self.port = port if port is not None else free_port()
        child_env = dict(os.environ if env is None else env)
        child_env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(REPO), child_env.get("PYTHONPATH")])
        )
        flags = ["--log-format", "json", "--port", str(self.port), *args]
        self.started_at = time.perf_counter()
        self.proc: subprocess.Popen[str] | ForkedChild
        if forkserver is None:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "engine", *flags],
                stderr=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                text=True,
                env=child_env,
            )
            assert self.proc.stderr is not None
            stream: IO[str] = self.proc.stderr
        else:
            self.proc, stream = ForkedChild.start(forkserver, flags, child_env)
        self.lines: list[str] = []
        self.ready: dict[str, Any] | None = None
        self.ready_at = 0.0
        self._changed = threading.Event()
        self._line = threading.Condition()  # notified on every line and at exit
        self.exited = threading.Event()
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def _pump(self, stream: IO[str]) -> None:
        for line in stream:
            with self._line:
                self.lines.append(line)
                self._line.notify_all()
            if '"event": "ready"' in line or '"event": "following rank 0"' in line:
                self.ready_at = time.perf_counter()
                self.ready = json.loads(line)
                self._changed.set()
        stream.close()
        with contextlib.suppress(EngineError):  # forked, and its server died: code unknown
            self.proc.wait()
        self.exited.set()
        self._changed.set()
        with self._line:
            self._line.notify_all()

    def events(self, name: str) -> list[dict[str, Any]]:
        """Every JSON log event called `name`, so far."""
        found = (json.loads(line) for line in list(self.lines) if line.startswith("{"))
        return [e for e in found if e.get("event") == name]

    def wait_events(self, name: str, count: int, timeout: float = 30.0) -> list[dict[str, Any]]:
        """The `name` events once there are `count` of them (or the engine exited, or
        `timeout` passed: the caller checks how many came)."""
        with self._line:
            self._line.wait_for(
                lambda: len(self.events(name)) >= count or self.exited.is_set(), timeout
            )
        return self.events(name)

    def wait_ready(self, timeout: float = 120.0) -> dict[str, Any]:
        """The "ready" event; raises with the child's last log lines if it never came."""
        self._changed.wait(timeout)
        if self.ready is None:
            raise EngineError(
                f"engine on port {self.port} not ready after {timeout} s "
                f"(exit code {self.proc.poll()}):\n" + "".join(self.lines[-20:])
            )
        return self.ready

    def wait_exit(self, timeout: float = 30.0) -> int:
        if not self.exited.wait(timeout):
            raise EngineError(f"engine on port {self.port} still running after {timeout} s")
        return self.proc.wait(5)

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM, then SIGKILL after `timeout`; the exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.exited.wait(5)
        return self.proc.wait(5)
