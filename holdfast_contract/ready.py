"""The ready file a cache daemon writes when it serves: `<run>/daemon-<rank>.ready`.

JSON, written atomically (a temporary file renamed over it), removed when the daemon stops.
The supervisor waits for the one that names its daemon's pid; a starting daemon (or spare)
reads it to learn whether the rank is served by a live process already.
"""

from __future__ import annotations

from pathlib import Path

import msgspec


class DaemonReady(msgspec.Struct, frozen=True):
    pid: int
    start_time: int | None  # clock ticks since boot (/proc/<pid>/stat): with pid, one process
    socket: str  # the daemon's unix socket
    fingerprint: str  # of the CacheConfig its pool was built for
    adopted: bool = False  # the pool came from the keeper's escrow, not from disk


_decoder = msgspec.json.Decoder(DaemonReady)


def daemon_ready_path(run: Path, rank: int) -> Path:
    return run / f"daemon-{rank}.ready"


def read_daemon_ready(path: Path) -> DaemonReady | None:
    """The ready file at `path`, or None while there is none or it is not one."""
    try:
        return _decoder.decode(path.read_bytes())
    except (OSError, msgspec.DecodeError):
        return None


def drop_stale(socket: Path, ready: Path) -> None:
    """Remove a rank's socket and ready file unless the process the ready file names
    (pid and start time) still lives: what a daemon killed before its own cleanup left."""
    info = read_daemon_ready(ready)
    if info is not None and is_alive(info.pid, info.start_time):
        return
    for p in (socket, ready):
        p.unlink(missing_ok=True)


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks, or None if it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def is_alive(pid: int, started: int | None) -> bool:
    """`pid` runs, and is the process that started at `started` (None: any)."""
    now = start_time(pid)
    return now is not None and (started is None or now == started)
