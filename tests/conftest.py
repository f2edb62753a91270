"""Shared fixtures: generated checkpoints and real daemon processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from tests.fleet_etcd import Etcd

REPO = Path(__file__).resolve().parent.parent


def chaos_run(
    scenario: Path, out: Path, *extra: str, timeout: float = 300
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """`python -m chaos run SCENARIO --out OUT EXTRA...` with this tree first on the path:
    how it ended, and its results.json."""
    done = subprocess.run(
        [sys.executable, "-m", "chaos", "run", str(scenario), "--out", str(out), *extra],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return done, json.loads((out / "results.json").read_text())


def has_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu = [item for item in items if "gpu" in item.keywords]
    if not gpu or has_cuda():  # torch is imported only when a gpu test was collected
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in gpu:
        item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def session_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    """The test session's own mosquitto on a free loopback port, stopped at the end; tests
    find it through HOLDFAST_MQTT_HOST/PORT. A broker the machine happens to run is never
    used."""
    from tests.mqtt_broker import SessionBroker

    broker = SessionBroker(tmp_path_factory.mktemp("mqtt"))
    saved = {k: os.environ.get(k) for k in ("HOLDFAST_MQTT_HOST", "HOLDFAST_MQTT_PORT")}
    os.environ["HOLDFAST_MQTT_HOST"], os.environ["HOLDFAST_MQTT_PORT"] = (
        broker.host,
        str(broker.port),
    )
    try:
        yield broker.host, broker.port
    finally:
        broker.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[Etcd]:
    """One real etcd member on free loopback ports, killed after the test."""
    from tests.fleet_etcd import Etcd

    server = Etcd(tmp_path)
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from cachedaemon.checkpoint_gen import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("models") / "tiny", "tiny")


@pytest.fixture(scope="session")
def next_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's next version, for updates and refits: its shapes, other weights."""
    from cachedaemon.checkpoint_gen import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("models") / "tiny-v2", "tiny", seed=1)


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


class LoggedProc:
    """A real child process whose stderr log lines are kept; `wait_for` waits on them."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env=child_env())
        self.lines: list[str] = []
        self.exited = threading.Event()
        self._line = threading.Condition()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._line:
                self.lines.append(line)
                self._line.notify_all()
        self.proc.stderr.close()
        with self._line:
            self.exited.set()
            self._line.notify_all()

    def wait_for(self, text: str, timeout: float = 60.0, count: int = 1) -> list[str]:
        """Until `count` log lines contain `text` (those lines); AssertionError if it exits
        or time runs out first."""

        def found() -> list[str]:
            return [line for line in self.lines if text in line]

        with self._line:
            self._line.wait_for(lambda: len(found()) >= count or self.exited.is_set(), timeout)
            if len(found()) < count:
                raise AssertionError(
                    f"{self.proc.args[:4]} logged {text!r} {len(found())} times, not {count}:\n"
                    + "".join(self.lines[-30:])
                )
            return found()

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.wait()
        self.exited.wait(5)


class DaemonProc(LoggedProc):
    """A real `cachedaemon serve` process."""

    def __init__(self, args: list[str]) -> None:
        super().__init__([sys.executable, "-m", "cachedaemon", "--log-format", "json", *args])

    def wait_serving(self, timeout: float = 60.0) -> None:
        self.wait_for('"event": "serving"', timeout)


class Daemons:
    """Starts daemons; stops every one it started."""

    def __init__(self) -> None:
        self.procs: list[DaemonProc] = []

    def __call__(self, model: Path, run_dir: Path, *extra: str, wait: bool = True) -> DaemonProc:
        d = DaemonProc(["serve", "--model", str(model), "--runtime-dir", str(run_dir), *extra])
        self.procs.append(d)
        if wait:
            d.wait_serving()
        return d

    def stop_all(self) -> None:
        for d in self.procs:
            d.stop()


@pytest.fixture
def start_daemon() -> Iterator[Daemons]:
    daemons = Daemons()
    yield daemons
    daemons.stop_all()


@pytest.fixture(scope="module")
def module_daemons() -> Iterator[Daemons]:
    daemons = Daemons()
    yield daemons
    daemons.stop_all()


class ForkServerProc(LoggedProc):
    """A real `python -m engine.forkserver` serving on `sock`."""

    def __init__(self, sock: Path, *extra: str) -> None:
        self.sock = sock
        argv = [sys.executable, "-m", "engine.forkserver", "--socket", str(sock)]
        super().__init__([*argv, "--log-format", "json", *extra])

    def wait_ready(self) -> None:
        self.wait_for("forkserver ready", 120)


@pytest.fixture(scope="module")
def forkserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForkServerProc]:
    """An engine fork server for the whole module."""
    server = ForkServerProc(tmp_path_factory.mktemp("fork") / "forkserver.sock")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The `fuzz` properties tests recorded (tests/holdfast_contract/test_fuzz_wire.py): what each sent."""
    lines = [
        str(value)
        for key in ("passed", "failed")
        for report in terminalreporter.stats.get(key, [])
        if getattr(report, "when", "") == "call"
        for name, value in getattr(report, "user_properties", [])
        if name == "fuzz"
    ]
    if lines:
        terminalreporter.section("fuzzed socket protocols")
        for line in lines:
            terminalreporter.write_line(f"fuzz: {line}")
