"""Forks: a child that runs one function and exits, and a fork that dies with its owner (the
supervisor that asked for it, or the fork server)."""

from __future__ import annotations

import os
import selectors
import signal
import sys
import threading
import traceback
from collections.abc import Callable


def die_with(pid: int, unless: threading.Event | None = None) -> None:
    """SIGKILL this process the moment `pid` exits (or now, if it already has), unless
    `unless` is set by then."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        os.kill(os.getpid(), signal.SIGKILL)
        return

    def watch() -> None:
        sel = selectors.DefaultSelector()
        sel.register(pidfd, selectors.EVENT_READ)
        sel.select()
        if unless is None or not unless.is_set():
            os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="die-with-owner", daemon=True).start()


def fork_running(child: Callable[[], int]) -> int:
    """Fork; the child runs `child` and exits with its status (1, its traceback printed, if
    it raised), never returning. In this process: the child's pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        code = child()
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
