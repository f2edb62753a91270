"""Process helpers for the GPU benchmarks: keeper and daemon processes with their JSON logs,
page-cache dropping, nvidia-smi memory readings."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), e.get("PYTHONPATH")]))
    e["PYTHONUNBUFFERED"] = "1"
    return e


def drop_caches(files: list[Path]) -> str:
    """Drop the page cache (all of it as root, else these files'); says which was done."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    except OSError:
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        return "fadvise"


def gpu_used_mib() -> int:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    return int(out.split()[0])


def gpu_apps() -> dict[int, int]:
    """nvidia-smi's compute processes: pid -> used MiB ({} without nvidia-smi)."""
    q = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(q, capture_output=True, text=True, timeout=30, check=False).stdout
    except OSError:
        return {}
    got = {}
    for line in out.splitlines():
        pid, _, mb = line.partition(",")
        if pid.strip().isdigit() and mb.strip().isdigit():
            got[int(pid)] = int(mb)
    return got


class Proc:
    """`python -m cachedaemon ARGS` with JSON logs; waits for a log event with a deadline."""

    def __init__(self, *args: str) -> None:
        self.t0 = time.time()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cachedaemon", "--log-format", "json", *args],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env=env(),
        )
        self.events: list[dict[str, Any]] = []
        self._cv = threading.Condition()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                continue
            ev["_at"] = time.time()
            with self._cv:
                self.events.append(ev)
                self._cv.notify_all()
        with self._cv:
            self.events.append({"event": "_exit", "_at": time.time()})
            self._cv.notify_all()

    def wait_for(self, event: str, timeout: float = 300) -> dict[str, Any]:
        def found() -> dict[str, Any] | None:
            for ev in self.events:
                if ev.get("event") in (event, "_exit"):
                    return ev
            return None

        with self._cv:
            ev = self._cv.wait_for(found, timeout)
        if not ev or ev["event"] != event:
            tail = [e.get("event") for e in self.events[-10:]]
            raise RuntimeError(f"no {event!r} from {self.proc.args}: {tail}")
        return ev

    def event(self, name: str) -> dict[str, Any] | None:
        return next((e for e in self.events if e.get("event") == name), None)

    def since_start(self, ev: dict[str, Any]) -> float:
        return float(ev["_at"] - self.t0)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)


def log_ts(ev: dict[str, Any]) -> float:
    return datetime.datetime.fromisoformat(str(ev["timestamp"]).replace("Z", "+00:00")).timestamp()


def stamp(argv: list[str]) -> dict[str, str]:
    import socket

    import torch

    return {
        "command": " ".join([Path(sys.executable).name, *argv]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{socket.gethostname()}: {torch.cuda.get_device_name(0)}, "
        f"{os.cpu_count()} cpus, torch {torch.__version__}, cuda {torch.version.cuda}",
    }
