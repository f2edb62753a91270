"""A start-up that cannot listen fails at once and cleanly: one clear error on stderr, exit 1,
no process left behind, the runtime dir free for the next run; also with the CPUs busy and
a broker connection being set up as it fails (where a lost cancellation used to hang it)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest
import yaml

from supervisor.runtime import holder_pid
from tests.engines.harness import Supervisor, env, mqtt_broker, topic, write_policy

STARTS = 8  # each start must fail the same clean way
DEADLINE_S = 30.0  # a bound on a hang, not a speed: these exits take under 2 s on an idle machine


@pytest.fixture
def cpu_load() -> Iterator[None]:
    """Two busy-loop processes, one per core of the CI machine, while the test runs."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        yield
    finally:
        for h in hogs:
            h.kill()
            h.wait()


@contextmanager
def tcp_listener(port: int) -> Iterator[None]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        yield


@contextmanager
def unix_listener(path: Path) -> Iterator[None]:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))
        s.listen()
        try:
            yield
        finally:
            path.unlink()


def marked_pids(mark: str) -> list[int]:
    """Live processes whose environment carries `mark` (every child inherits it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if f"HOLDFAST_TEST_MARK={mark}".encode() in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def start_once(policy: Path, mark: str) -> tuple[float, int, str]:
    """One `supervisor run`: seconds to exit, its code, its stderr (killed past DEADLINE_S)."""
    e = {**env(), "HOLDFAST_TEST_MARK": mark}
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "supervisor", "run", str(policy)],
        env=e,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _, err = proc.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate()
        raise AssertionError(f"still running after {DEADLINE_S}s; stderr:\n{err}") from None
    return time.monotonic() - t0, proc.returncode, err


@pytest.mark.slow
@pytest.mark.parametrize("listener", ["router", "api", "control"])
def test_busy_listener_fails_fast_and_clean(
    listener: str, tmp_path: Path, tiny_model: Path, cpu_load: None
) -> None:
    host, port = mqtt_broker()
    run = tmp_path / "run"
    policy = write_policy(
        tmp_path / "p.yaml",
        tiny_model,
        run,
        events={"mqtt": {"host": host, "port": port, "prefix": f"hf-test/{uuid.uuid4().hex}"}},
        log={"level": "warning"},  # so that stderr holds the error alone
    )
    text = policy.read_text()
    key = {"router": "router", "api": "api"}.get(listener)
    busy: AbstractContextManager[None]
    if key is not None:
        listen = yaml.safe_load(text)[key]["listen"]
        busy = tcp_listener(int(listen.rpartition(":")[2]))
        expected = f"supervisor: cannot listen on {listen} ({key}.listen): address already in use"
    else:
        busy = unix_listener(run / "control")
        expected = f"supervisor: cannot listen on ipc://{run / 'control'}: another process"
    mark = uuid.uuid4().hex
    times = []
    with busy:
        for i in range(STARTS):
            seconds, code, err = start_once(policy, mark)
            times.append(seconds)
            assert code == 1, f"start {i}: exit {code}:\n{err}"
            lines = err.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith(expected), f"start {i}:\n{err}"
            assert marked_pids(mark) == [], f"start {i} left processes behind"
            assert holder_pid(run) is None
    times.sort()
    print(
        f"\n{listener} busy, {STARTS} starts under CPU load: exit after "
        f"median {times[len(times) // 2]:.2f} s, max {times[-1]:.2f} s"
    )
    # the dir is usable: with the listener free again, a run comes up
    sup = Supervisor(policy)
    try:
        sup.wait(topic("supervisor.main.started"), timeout=120)
        assert sup.stop(signal.SIGTERM) == 0
    finally:
        if sup.proc.poll() is None:
            sup.stop(signal.SIGKILL)


def test_a_non_socket_in_the_way_is_refused_untouched(tmp_path: Path, tiny_model: Path) -> None:
    run = tmp_path / "run"
    (run / "agents").mkdir(parents=True)
    (run / "agents" / "keep.txt").write_text("theirs")
    policy = write_policy(tmp_path / "p.yaml", tiny_model, run, log={"level": "warning"})
    seconds, code, err = start_once(policy, uuid.uuid4().hex)
    assert code == 1, err
    assert err.strip() == (
        f"supervisor: cannot listen on ipc://{run / 'agents'}: something that is not a socket "
        f"is in the way; remove {run / 'agents'} or set cache.runtime_dir"
    )
    assert (run / "agents" / "keep.txt").read_text() == "theirs"
    assert os.path.isdir(run / "agents")
