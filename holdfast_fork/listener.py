"""The fork server's socket, and a request on it that is still arriving."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from cachedaemon.rundir import listen
from holdfast_contract import wire
from holdfast_contract.forkserver import MAX_FRAME
from holdfast_fork.errors import ForkError

READ_TIMEOUT = 5.0  # seconds a peer has to send its whole request


def bind(path: Path) -> socket.socket:
    """Listen on `path`: refused if a server answers there, a dead one's socket replaced."""
    if wire.socket_answers(path):
        raise ForkError(f"a fork server already listens on {path}")
    path.unlink(missing_ok=True)  # left by one that died
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    staging.unlink(missing_ok=True)
    listener = listen(staging, backlog=64)
    os.rename(staging, path)  # the path appears only once it accepts connections
    return listener


class Request:
    """A connection whose request is still arriving (a `wire.FrameReader`), its deadline,
    and the refusal it gets once read, if any."""

    def __init__(self, conn: socket.socket, refusal: str = "") -> None:
        self.conn = conn
        self.refusal = refusal  # read it all the same, then refuse it with this
        self.reader = wire.FrameReader(max_frame=MAX_FRAME, max_fds=3)
        self.fds = self.reader.fds  # stdin, stdout, stderr once it is whole
        self.deadline = time.monotonic() + READ_TIMEOUT

    def feed(self) -> bytes | None:
        """Read what has arrived; the body once whole, else None. Raises ProtocolError or
        EOFError on a bad frame or a closed connection (the fds stay in `fds`)."""
        return self.reader.feed(self.conn)

    def close(self) -> None:
        wire.close_fds(self.fds)
        self.conn.close()
