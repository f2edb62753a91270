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


class Etcd:
    """`etcd` on 127.0.0.1:<free port>; `stop()` (SIGSTOP) freezes it, `cont()` resumes."""

    def __init__(self, data: Path, port: int = 0) -> None:
        if shutil.which("etcd") is None:
            raise RuntimeError("etcd not installed: apt-get install -y etcd-server")
        self.port, peer = port or free_port(), free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.log = data / "etcd.log"
        peer_url = f"http://127.0.0.1:{peer}"
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
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        self.frozen = False
        self.wait_healthy(60.0)

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
