"""Driving a real `supervisor run` from tests: the process, its event stream, its API."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
import zmq

from holdfast_contract.events import Event, decode_event
from holdfast_contract.wire import free_port

REPO = Path(__file__).resolve().parents[2]
ECHO = ["{python}", "-m", "tests.engines.echo"]


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), e.get("PYTHONPATH")]))
    e["PYTHONUNBUFFERED"] = "1"
    return e


def mqtt_broker() -> tuple[str, int]:
    """The test session's own broker (conftest's `session_broker` sets these)."""
    return os.environ["HOLDFAST_MQTT_HOST"], int(os.environ["HOLDFAST_MQTT_PORT"])


def write_policy(path: Path, checkpoint: Path, run: Path, **sections: Any) -> Path:
    policy: dict[str, Any] = {
        "model": {"path": str(checkpoint), "dtype": "float32"},
        "cache": {"runtime_dir": str(run)},
        "engines": {"command": ECHO, "standby": 1, "stop_grace_s": 1.0},
        "router": {"listen": f"127.0.0.1:{free_port()}"},
        "api": {"listen": f"127.0.0.1:{free_port()}"},
    }
    for key, value in sections.items():
        policy[key] = {**policy.get(key, {}), **value}
    path.write_text(yaml.safe_dump(policy))
    return path


class EventTap:
    """Every event the supervisor publishes on ipc://<run>/events, collected in a thread."""

    def __init__(self, run: Path) -> None:
        self.events: list[Event] = []
        self._cond = threading.Condition()
        self._stop = threading.Event()
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(f"ipc://{run}/events")
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(100):
                _topic, body = self._sock.recv_multipart()
                with self._cond:
                    self.events.append(decode_event(body))
                    self._cond.notify_all()

    def wait(self, pred: Callable[[Event], bool], timeout: float, after: int = 0) -> Event:
        """The first event at index >= `after` matching `pred`, waiting up to `timeout`."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for ev in self.events[after:]:
                    if pred(ev):
                        return ev
                left = deadline - time.monotonic()
                if left <= 0:
                    seen = [e.topic for e in self.events[after:]][-30:]
                    raise AssertionError(f"no matching event within {timeout}s; saw {seen}")
                self._cond.wait(left)

    def mark(self) -> int:
        with self._cond:
            return len(self.events)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close(linger=0)


def topic(t: str) -> Callable[[Event], bool]:
    return lambda ev: ev.topic == t


class Supervisor:
    """One `python -m supervisor run POLICY` process with an event tap."""

    def __init__(self, policy: Path) -> None:
        self.policy_path = policy
        self.policy = yaml.safe_load(policy.read_text())
        self.run = Path(self.policy["cache"]["runtime_dir"])
        self.run.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.tap = EventTap(self.run)
        self.log = policy.with_suffix(".log")
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "supervisor", "run", str(policy)],
                env=env(),
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.router = "http://" + self.policy["router"]["listen"]
        self.api = "http://" + self.policy["api"]["listen"]

    def wait(self, pred: Callable[[Event], bool], timeout: float = 30.0, after: int = 0) -> Event:
        """The first event matching `pred` (see EventTap.wait); an AssertionError with the
        supervisor's output as soon as it has exited (looked at every second)."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"supervisor exited {self.proc.returncode}:\n{self.output()}")
            left = deadline - time.monotonic()
            try:
                return self.tap.wait(pred, min(1.0, max(left, 0.0)), after)
            except AssertionError:
                if left <= 1.0:
                    raise

    def wait_pair(self, timeout: float = 180.0) -> Event:
        """Until one engine is promoted and another is ready beside it; the promotion."""
        first = self.wait(lambda e: e.event == "promoted", timeout=timeout)
        self.wait(lambda e: e.event == "ready" and e.name != first.name, timeout=timeout)
        return first

    def kill_primary(self, first: Event) -> Event:
        """kill -9 the primary promoted by `first`; the next promotion, of another engine."""
        mark = self.tap.mark()
        os.kill(get(f"{self.api}/primary")[1]["pid"], signal.SIGKILL)
        second = self.wait(lambda e: e.event == "promoted", timeout=5, after=mark)
        assert second.name != first.name and second.epoch == first.epoch + 1
        return second

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        cp = subprocess.run(
            [sys.executable, "-m", "supervisor", *args, "--runtime-dir", str(self.run)],
            env=env(),
            capture_output=True,
            text=True,
            timeout=30,
        )
        if check and cp.returncode != 0:
            raise AssertionError(f"supervisor {args} failed: {cp.stderr}")
        return cp

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(self.cli("status", "--json").stdout)
        return out

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.tap.close()
        return code


def get(url: str, timeout: float = 5.0) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def complete(
    router: str, prompt: str | None = "hi", timeout: float = 10.0, **extra: Any
) -> tuple[int, dict[str, Any]]:
    fields = {"prompt": prompt, **extra} if prompt is not None else extra
    body = json.dumps(fields).encode()
    req = urllib.request.Request(
        f"{router}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body: dict[str, Any] = json.loads(r.read())
            body.setdefault("engine", r.headers.get("X-Holdfast-Engine", ""))
            return r.status, body
    except urllib.error.HTTPError as e:
        return e.code, {"error": e.read().decode(errors="replace")}


class Load:
    """Clients sending requests through the router in threads; records every outcome."""

    def __init__(self, router: str, clients: int = 2, **extra: Any) -> None:
        self.router = router
        self.extra = extra
        self.ok = 0
        self.failures: list[str] = []
        self.engines: set[str] = set()
        self._stop = threading.Event()
        self._cond = threading.Condition()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                code, body = complete(self.router, **self.extra)
            except OSError as e:
                self.failures.append(repr(e))
                continue
            with self._cond:
                if code == 200:
                    self.ok += 1
                    self.engines.add(body["engine"])
                else:
                    self.failures.append(f"{code}: {body}")
                self._cond.notify_all()

    def wait_ok(self, more: int, timeout: float = 10.0) -> None:
        """Until `more` further requests succeeded (or the deadline passed)."""
        with self._cond:
            target = self.ok + more
            self._cond.wait_for(lambda: self.ok >= target, timeout)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=30)


def exits_within(pid: int, timeout: float) -> bool:
    """Whether process `pid` (anyone's child) has exited within `timeout` s: its pidfd
    turns readable at its exit, zombie or reaped."""
    import select

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False
