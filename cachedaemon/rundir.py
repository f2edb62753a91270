"""The runtime dir and its owner files: 0700 dirs, liveness by (pid, start time), atomic
ready files. A socket or ready file whose owner lives is never replaced."""

from __future__ import annotations

import json
import os
import socket
import tempfile
from pathlib import Path
from typing import Any

from cachedaemon.errors import SocketDirError
from holdfast_contract import wire
from holdfast_contract.ready import is_alive


def prepare(run_dir: str | Path) -> Path:
    """Create (0700) or check the runtime dir: ours, and writable."""
    path = Path(run_dir)
    old = os.umask(0o077)
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise SocketDirError(
            f"cannot create runtime dir {path}: {exc.strerror}; pass --runtime-dir a writable dir"
        ) from exc
    finally:
        os.umask(old)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise SocketDirError(
            f"runtime dir {path} belongs to uid {st.st_uid}, not {os.getuid()}; use a dir of your own"
        )
    try:
        with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
            pass
    except OSError as exc:
        raise SocketDirError(
            f"runtime dir {path} is not writable ({exc.strerror}); pass --runtime-dir a writable dir"
        ) from exc
    os.chmod(path, 0o700)
    return path


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def read_owner(ready: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(ready.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def claim(sock_path: Path, ready: Path, what: str) -> None:
    """Remove a stale socket / ready file; refuse if their owner still lives."""
    owner = read_owner(ready) or {}
    pid, started = owner.get("pid"), owner.get("start_time")
    if (
        isinstance(pid, int)
        and pid != os.getpid()
        and is_alive(pid, started if isinstance(started, int) else None)
    ):
        raise SocketDirError(
            f"{what} is already served by live pid {pid} ({ready}); "
            "stop it first or choose another --runtime-dir"
        )
    if wire.socket_answers(sock_path):
        raise SocketDirError(
            f"{sock_path} answers: another process serves {what}; stop it or choose another --runtime-dir"
        )
    for p in (sock_path, ready):
        p.unlink(missing_ok=True)


def listen(sock_path: Path, backlog: int = 128) -> socket.socket:
    old = os.umask(0o077)
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(sock_path))
        s.listen(backlog)
        return s
    finally:
        os.umask(old)
