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
