"""Looking for the primary's exit, and the promotion up to routed and told, as short
real-time stretches.

A SIGKILLed engine's last thread tears its address space down in the kernel (1-3.5 ms for
the echo engine on a 2-core VM; far more with a CUDA context) on whichever CPU the signal
woke it on. The exit watch sees the exit begin and the supervisor promotes at once, so
that teardown and the promotion overlap; where the kill woke the dying thread on the
supervisor's CPU, it preempts the supervisor for the teardown's length, even with the
other core idle. Scheduler tracing (sched_switch, 100 kills) showed this in every
promotion that took over 1 ms.

`RealtimeSection` runs the supervisor's thread as SCHED_FIFO priority 1, which no task of
the normal classes preempts: the exit watch enters it for each look at the primary's
processes (`supervisor.exitwatch`), leaves it at once when the look saw nothing, and
otherwise the promotion leaves it once the standby is routed to and told (the event's
publication and the log run as before). The switch is thus made before an exit is seen,
not in the response to it: cold, it took 17 µs of a 170 µs promotion. The cost is two
system calls per look (every `heartbeat.exit_poll_ms`). Children never inherit it
(SCHED_RESET_ON_FORK). It needs CAP_SYS_NICE (root) or an RLIMIT_RTPRIO of at least 1:
without either, or with `heartbeat.realtime_promotion: false`, it does nothing (said once,
at start, in the log); a thread started under another policy than the normal one is left
as it is.
"""

from __future__ import annotations

import os

import structlog

log = structlog.get_logger("supervisor")

PRIORITY = 1  # the lowest real-time priority: above every normal task, below all others


class RealtimeSection:
    """`enter` and `leave` on the thread that promotes; `held` while inside. Whether the
    policy may be used is tried once, when made (so a refusal is logged at start, not in
    the middle of a failover)."""

    def __init__(self, enabled: bool) -> None:
        self.held = False
        self._fifo = (os.SCHED_FIFO | os.SCHED_RESET_ON_FORK, os.sched_param(PRIORITY))
        self._other = (os.SCHED_OTHER, os.sched_param(0))
        self.enabled = enabled and os.sched_getscheduler(0) == os.SCHED_OTHER
        if self.enabled:
            try:
                os.sched_setscheduler(0, *self._fifo)
                os.sched_setscheduler(0, *self._other)
            except PermissionError:
                self.enabled = False
                log.warning(
                    "promotions run at normal priority: SCHED_FIFO needs root, CAP_SYS_NICE "
                    "or an RLIMIT_RTPRIO of 1 (heartbeat.realtime_promotion: false silences this)"
                )

    def enter(self) -> None:
        if self.enabled and not self.held:
            os.sched_setscheduler(0, *self._fifo)
            self.held = True

    def leave(self) -> None:
        if self.held:
            self.held = False
            os.sched_setscheduler(0, *self._other)
