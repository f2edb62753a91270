"""A rank's socket and ready file after its daemon is gone: removed once the process the
ready file names has exited (or its pid now belongs to another process), kept while it runs."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

from holdfast_contract.ready import daemon_ready_path, drop_stale, start_time


def _files(run: Path, pid: int, started: int | None) -> tuple[Path, Path]:
    sock = run / "daemon-0.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(sock))
    s.close()  # the socket file stays, as a killed daemon leaves it
    ready = daemon_ready_path(run, 0)
    info = {"pid": pid, "start_time": started, "socket": str(sock), "fingerprint": "f"}
    ready.write_text(json.dumps(info))
    return sock, ready


def test_the_files_of_a_live_daemon_are_kept_and_a_dead_ones_removed(tmp_path: Path) -> None:
    proc = subprocess.Popen(["sleep", "60"])
    try:
        sock, ready = _files(tmp_path, proc.pid, start_time(proc.pid))
        drop_stale(sock, ready)
        assert sock.exists() and ready.exists()
    finally:
        proc.kill()
        proc.wait()
    drop_stale(sock, ready)
    assert not sock.exists() and not ready.exists()


def test_a_ready_file_whose_pid_was_reused_is_stale(tmp_path: Path) -> None:
    proc = subprocess.Popen(["sleep", "60"])
    try:
        started = start_time(proc.pid)
        assert started is not None
        sock, ready = _files(tmp_path, proc.pid, started - 1)  # another process's start
        drop_stale(sock, ready)
        assert not sock.exists() and not ready.exists()
    finally:
        proc.kill()
        proc.wait()


def test_a_socket_without_a_ready_file_is_stale(tmp_path: Path) -> None:
    sock, ready = _files(tmp_path, 1, None)
    ready.unlink()
    drop_stale(sock, ready)
    assert not sock.exists()
