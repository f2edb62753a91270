"""The test session's MQTT broker: a real mosquitto on a free loopback port, started and
stopped by the session (conftest's `session_broker`), never the machine's own."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

from chaos.broker import free_port, mosquitto_binary


class SessionBroker:
    def __init__(self, workdir: Path, timeout: float = 20.0) -> None:
        self.host, self.port = "127.0.0.1", free_port()
        conf = workdir / "mosquitto.conf"
        conf.write_text(
            f"listener {self.port} {self.host}\nallow_anonymous true\npersistence false\n"
            "log_dest stderr\nlog_type information\n"
        )
        self.proc = subprocess.Popen(
            [mosquitto_binary(), "-c", str(conf)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._running = threading.Event()
        self._seen: list[str] = []
        self._pumping = threading.Thread(target=self._pump, daemon=True)
        self._pumping.start()
        if not self._running.wait(timeout):
            self.stop()
            raise RuntimeError(
                f"mosquitto did not listen on {self.host}:{self.port} in {timeout} s: "
                + " | ".join(self._seen[-5:])
            )

    def _pump(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:  # read to the end, so the broker never blocks on it
            if len(self._seen) < 50:
                self._seen.append(line.strip())
            if line.rstrip().endswith(" running"):
                self._running.set()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._pumping.join(5)
        if self.proc.stderr is not None:
            self.proc.stderr.close()
