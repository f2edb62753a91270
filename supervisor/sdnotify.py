"""systemd's readiness protocol (sd_notify), without libsystemd.

Under a unit with `Type=notify`, systemd sets `NOTIFY_SOCKET` to a unix datagram socket
(a path, or `@name` in the abstract namespace); one datagram `READY=1` there tells it the
service is up. Without `NOTIFY_SOCKET` (not started by systemd) `notify` does nothing.
"""

from __future__ import annotations

import os
import socket

import structlog

log = structlog.get_logger("supervisor.sdnotify")
ENV = "NOTIFY_SOCKET"


def address(value: str) -> str | bytes:
    """NOTIFY_SOCKET's value as a socket address: `@name` is the abstract `\\0name`."""
    if value.startswith("@"):
        return b"\0" + value[1:].encode()
    return value


def notify(*fields: str) -> bool:
    """Send `fields` (`READY=1`, `STATUS=...`) as one datagram; True if one was sent.

    A socket that cannot be reached is logged, never raised: readiness reporting must not
    stop a supervisor that is otherwise serving (systemd then times the start out itself).
    """
    value = os.environ.get(ENV, "")
    if not value:
        return False
    if not (value.startswith("/") or value.startswith("@")):
        log.warning("notify socket ignored", socket=value, why="neither a path nor @abstract")
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        try:
            s.sendto("\n".join(fields).encode(), address(value))
        except OSError as e:
            log.warning("notify failed", socket=value, error=str(e))
            return False
    return True


def ready(status: str) -> bool:
    """Tell systemd the supervisor serves: `READY=1` and a status line for `systemctl status`."""
    return notify("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")
