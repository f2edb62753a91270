"""CPU priority by role: the serving primary's threads before every other engine's.

A promoted standby must compute its continuations at once, on a machine where the dead
primary's memory is being torn down, the replacement is starting and batch engines run
(bench/results/chaos-streams/: on two cores, a continuation waited 10-30 ms for one).
Linux keeps a nice value per thread, so each thread of the engine's processes (and of
their children: vLLM's EngineCore) is set; threads started later inherit it from the
thread that starts them. Lowering a nice value needs CAP_SYS_NICE (root); without it the
change is skipped and said once.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator

import structlog

log = structlog.get_logger("supervisor.priority")
_warned = False


def threads(pids: Iterable[int]) -> Iterator[int]:
    """Every thread of `pids` and of their descendants."""
    todo, seen = list(pids), set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            yield int(tid)
            with (
                contextlib.suppress(OSError, ValueError),
                open(f"/proc/{pid}/task/{tid}/children") as f,
            ):
                todo += [int(c) for c in f.read().split()]


def renice(pids: Iterable[int], nice: int) -> int:
    """Set the nice value of every thread of `pids` (and their children); how many."""
    global _warned
    done = 0
    for tid in threads(pids):
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
            done += 1
        except ProcessLookupError:
            continue
        except PermissionError:
            if not _warned:
                _warned = True
                log.warning(
                    "priority_unchanged",
                    nice=nice,
                    why="a lower nice value needs root or CAP_SYS_NICE; set "
                    "engines.primary_nice: 0 to leave priorities alone",
                )
            return done
    return done
