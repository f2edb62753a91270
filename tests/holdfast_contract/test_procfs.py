"""Whether a process may run user code still: a stopped one may (it runs once continued),
a killed one may not from the moment SIGKILL is sent, before it is reaped, nor one whose
pid names another process now."""

from __future__ import annotations

import os
import signal
import subprocess

from holdfast_contract.procfs import runs_user_code
from holdfast_contract.ready import start_time


def test_a_stopped_process_runs_and_a_killed_one_does_not_before_it_is_reaped() -> None:
    proc = subprocess.Popen(["sleep", "60"])
    try:
        started = start_time(proc.pid)
        assert runs_user_code(proc.pid, started)
        os.kill(proc.pid, signal.SIGSTOP)
        assert runs_user_code(proc.pid, started)
        assert not runs_user_code(proc.pid, (started or 0) + 1)  # another process's start
        os.kill(proc.pid, signal.SIGKILL)
        assert not runs_user_code(proc.pid, started)  # not reaped yet: a zombie at most
        assert os.path.exists(f"/proc/{proc.pid}")
    finally:
        proc.kill()
        proc.wait()
    assert not runs_user_code(proc.pid, started)
