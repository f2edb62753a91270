"""A real etcd for the fleet tests: one member on free loopback ports in a temp dir."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from holdfast_contract.wire import free_port

ATTEMPTS = 5  # starts on freshly drawn ports, when one drawn free was taken meanwhile
IN_USE = "address already in use"


class Etcd:
    """`etcd` on 127.0.0.1:<free port>; `stop()` (SIGSTOP) freezes it, `cont()` resumes."""

    def __init__(self, data: Path, port: int = 0) -> None:
        if shutil.which("etcd") is None:
            raise RuntimeError("etcd not installed: apt-get install -y etcd-server")
        self.log = data / "etcd.log"
        self.frozen = False
        for attempt in range(1, ATTEMPTS + 1):
            self.port = port or free_port()
            peer = free_port()
            while peer == self.port:
                peer = free_port()
            self.endpoint = f"127.0.0.1:{self.port}"
            self._start(data, f"http://127.0.0.1:{peer}")
            try:
                self.wait_healthy(60.0)
                return
            except RuntimeError:
                taken = self.proc.poll() is not None and IN_USE in self.log.read_text()
                if not taken or attempt == ATTEMPTS:
                    raise
            # a port drawn free was taken by another process before etcd bound it: the
            # member it began is dropped, and it starts again on other ports
            shutil.rmtree(data / "data", ignore_errors=True)

    def _start(self, data: Path, peer_url: str) -> None:
        argv = [
            "etcd",
            "--name=t",
            f"--data-dir={data / 'data'}",
            f"--listen-client-urls=http://{self.endpoint}",
            f"--advertise-client-urls=http://{self.endpoint}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=t={peer_url}",
        ]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"etcd exited {self.proc.returncode}: {self.log.read_text()[-2000:]}"
                )
            try:
                with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1) as r:
                    if b'"true"' in r.read():
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"etcd not healthy in {timeout} s: {self.log.read_text()[-2000:]}"
                )
            time.sleep(0.05)  # polling a process we do not control: no event to wait on

    def stop(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.frozen = True

    def cont(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)
        self.frozen = False

    def kill(self) -> None:
        if self.frozen:
            self.cont()
        self.proc.kill()
        self.proc.wait(timeout=30)
