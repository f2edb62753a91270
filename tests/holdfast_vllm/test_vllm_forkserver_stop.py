"""The vLLM fork server stops on SIGTERM whichever of its threads the signal lands on:
importing vLLM starts threads, and a signal taken by one of them used to leave the main
thread asleep in its select until the next request, so every stop of a vLLM policy waited
out the supervisor's grace and ended in SIGKILL."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from supervisor.kinds.vllm_spec import VllmSpec, python_of

VLLM_PYTHON = python_of(VllmSpec())
ROOT = Path(__file__).resolve().parents[2]
SYS_TGKILL = 234  # x86-64


def tgkill(pid: int, tid: int, sig: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(SYS_TGKILL, pid, tid, sig) != 0:
        raise OSError(ctypes.get_errno(), f"tgkill {pid} {tid}")


@pytest.mark.vllm
@pytest.mark.skipif(not Path(VLLM_PYTHON).is_file(), reason="no vLLM venv")
@pytest.mark.skipif(os.uname().machine != "x86_64", reason="tgkill's number is x86-64's")
def test_sigterm_to_any_thread_stops_the_vllm_fork_server(tmp_path: Path) -> None:
    sock, log = tmp_path / "fs.sock", tmp_path / "fs.log"
    with log.open("wb") as out:
        server = subprocess.Popen(
            [VLLM_PYTHON, "-m", "holdfast_vllm.forkserver", "--socket", str(sock)],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    try:
        deadline = time.monotonic() + 600  # importing vLLM on a busy machine: only a bound
        while b"forkserver ready" not in log.read_bytes():
            assert server.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        others = [int(t) for t in os.listdir(f"/proc/{server.pid}/task") if int(t) != server.pid]
        assert others, "vLLM's import started no thread: this test would prove nothing"
        tgkill(server.pid, others[0], signal.SIGTERM)
        # an idle server gets no request: before, it slept in select until one came
        assert server.wait(timeout=120) == 0, log.read_text()
        assert not sock.exists()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
