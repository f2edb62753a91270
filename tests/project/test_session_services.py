"""The test session brings its own services: the broker the tests publish to is a child of
this session on a free port, never one the machine happens to run."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from tests.engines.harness import mqtt_broker


def _listener_pid(port: int) -> int:
    """The pid of the process holding the listening TCP socket on 127.0.0.1:port."""
    inode = ""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, state = fields[1], fields[3]
        if state == "0A" and int(local.split(":")[1], 16) == port:
            inode = fields[9]
    assert inode, f"nothing listens on port {port}"
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            for fd in fds:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]":
                    return int(pid)
        except OSError:
            continue
    raise AssertionError(f"no process holds the socket of port {port}")


def test_the_broker_is_the_sessions_own(session_broker: tuple[str, int]) -> None:
    host, port = mqtt_broker()
    assert (host, port) == session_broker
    assert port != 1883, "the tests must not use a broker the machine runs on 1883"
    with socket.create_connection((host, port), timeout=5):
        pass
    pid = _listener_pid(port)
    ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    assert ppid == os.getpid(), "the broker must be started (and stopped) by this session"
    assert Path(f"/proc/{pid}/comm").read_text().strip() == "mosquitto"
