"""Start `python -m engine` as a child process and wait for its "ready" line (no torch here).

Used by the startup benchmark and the tests: the child logs JSON lines on stderr, a thread
reads them, and waiters block on events with deadlines instead of polling the port.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from engine.errors import EngineError

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EngineProcess:
    """One engine child; `ready` is its parsed "ready" log line once it serves."""

    def __init__(
        self, args: Sequence[str], env: Mapping[str, str] | None = None, port: int | None = None
    ) -> None:
        self.port = port if port is not None else free_port()
        child_env = dict(os.environ if env is None else env)
        child_env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(REPO), child_env.get("PYTHONPATH")])
        )
        self.started_at = time.perf_counter()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "engine",
                "--log-format",
                "json",
                "--port",
                str(self.port),
                *args,
            ],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env=child_env,
        )
        self.lines: list[str] = []
        self.ready: dict[str, Any] | None = None
        self.ready_at = 0.0
        self._changed = threading.Event()
        self.exited = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def _pump(self) -> None:
        stream = self.proc.stderr
        if stream is None:
            return
        for line in stream:
            self.lines.append(line)
            if '"event": "ready"' in line or '"event": "following rank 0"' in line:
                self.ready_at = time.perf_counter()
                self.ready = json.loads(line)
                self._changed.set()
        stream.close()
        self.proc.wait()
        self.exited.set()
        self._changed.set()

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
        return int(self.proc.returncode)

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
        return int(self.proc.returncode)
