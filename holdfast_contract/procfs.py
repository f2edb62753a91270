"""Whether a process runs user code still, as /proc tells it: the supervisor's fence
(supervisor/exitwatch.py) and an engine taking over a dead one's KV cache
(engine/kvshare.py) both act once it does not."""

from __future__ import annotations

import signal

PF_EXITING = 0x4  # include/linux/sched.h: getting shut down
SIGKILL_BIT = 1 << (signal.SIGKILL - 1)


def stat_says_exiting(stat: bytes) -> bool:
    """Whether a /proc/<pid>/stat line is of a process that exits or has exited: state Z
    (zombie) or X (dead), or the PF_EXITING flag set (field 9)."""
    fields = stat[stat.rindex(b")") + 2 :].split()  # the name may hold spaces and ')'
    state, flags = fields[0], int(fields[6])
    return state in (b"Z", b"X", b"x") or bool(flags & PF_EXITING)


def status_says_killed(status: bytes) -> bool:
    """Whether /proc/<pid>/status shows SIGKILL pending (SigPnd: the thread's, ShdPnd: the
    process's): a killed process that has not been on a CPU since, which will run no more
    user code (a thread handles SIGKILL before any)."""
    for key in (b"\nSigPnd:", b"\nShdPnd:"):
        at = status.find(key)
        if at >= 0 and int(status[at + len(key) :].split(None, 1)[0], 16) & SIGKILL_BIT:
            return True
    return False


def _fields(pid: int, started: int | None) -> tuple[bytes, list[bytes]] | None:
    """Process `pid`'s /proc stat line and its fields after the name; None if it is gone
    or the pid names a process other than the one that started at `started`."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rindex(b")") + 2 :].split()  # the name may hold spaces and ')'
    if started is not None and int(fields[19]) != started:
        return None
    return stat, fields


def runs_user_code(pid: int, started: int | None) -> bool:
    """Whether process `pid`, the one that started at `started` (clock ticks; None: any),
    may still run user code: not gone, not a zombie, not exiting, no SIGKILL pending."""
    got = _fields(pid, started)
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            status = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return got is not None and not (stat_says_exiting(got[0]) or status_says_killed(status))


def has_exited(pid: int, started: int | None) -> bool:
    """Whether process `pid` (the one that started at `started`; None: any) is gone or a
    zombie: its exit is over, its files closed, and with them any device context it had,
    so nothing it queued on a device runs any more."""
    got = _fields(pid, started)
    return got is None or got[1][0] in (b"Z", b"X", b"x")
