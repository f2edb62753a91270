"""Whether this machine lets a test's thread run as SCHED_FIFO."""

from __future__ import annotations

import os


def realtime_allowed() -> bool:
    """Whether this process may switch a thread to SCHED_FIFO (root, CAP_SYS_NICE or an
    RLIMIT_RTPRIO of 1 or more)."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    except PermissionError:
        return False
    os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    return True
