"""The supervisor's decisions, as plain functions of a snapshot and a clock.

Who is promoted, whom to fence and why, which batch engine to evict and which to start
again, and what the rules want of each engine (published with its status): each is decided
here from the engines' records and `now`, and carried out by
`Crew` and `reconcile`. Nothing here awaits, spawns, signals or publishes, so each rule
is tested with a fake clock and no processes (tests/supervisor/test_decisions.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from supervisor.pace import SchedState
from supervisor.policy import LoadSpec, Policy
from supervisor.states import EngineState
from supervisor.units import Engine, Want


@dataclass(frozen=True)
class Windows:
    """How long an engine may take: to get ready, and between heartbeats."""

    ready_timeout_s: float
    hang_s: float  # heartbeat.miss_window_s, once ready
    starting_silence_s: float  # heartbeat.starting_silence_ms, while it starts
    busy_silence_s: float  # heartbeat.busy_silence_ms: silent, but runnable
    recheck_s: float  # how soon an overdue, runnable engine is looked at again
    look_s: float = 0.0  # a heartbeat this late gets a look (stopped?); 0: at the window

    @classmethod
    def of(cls, policy: Policy) -> Windows:
        hb = policy.heartbeat
        return cls(
            ready_timeout_s=policy.engines.ready_timeout_s,
            hang_s=hb.miss_window_s,
            starting_silence_s=hb.starting_silence_ms / 1000.0,
            busy_silence_s=hb.busy_silence_ms / 1000.0,
            recheck_s=hb.interval_ms / 2000.0,
            look_s=hb.interval_ms * 1.5 / 1000.0,
        )

    def silence_s(self, ready: bool) -> float:
        """How long an engine may go without a heartbeat before it is fenced as hung: the
        miss window once it is ready; while it starts (creating a CUDA context holds the
        GIL for a few hundred ms on a busy GPU) heartbeat.starting_silence_ms."""
        return self.hang_s if ready else max(self.hang_s, self.starting_silence_s)


def earliest(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    return a if b is None else min(a, b)


# ---- promotion ----
def best_standby(
    engines: Iterable[Engine], now: float, hang_s: float, prefer: str | None = None
) -> Engine | None:
    """The ready standby to promote: one whose heartbeat is fresh; `prefer` first (the
    router keeps streams' pasts warm there), then the least loaded, then the most recently
    heard from."""
    ready = [
        e
        for e in engines
        if e.state == EngineState.STANDBY
        and e.inc is not None
        and not e.inc.handled
        and now - e.last_beat < hang_s
    ]
    return min(
        ready, key=lambda e: (e.name != prefer, e.in_flight, now - e.last_beat), default=None
    )


# ---- liveness ----
@dataclass(frozen=True)
class Fence:
    cause: str  # promote-refused | not-ready | hang
    detail: str


@dataclass(frozen=True)
class Overdue:
    """A running engine silent past its window: fenced or not by `judge_silence`, once the
    kernel was asked what its processes do."""

    silent_s: float  # since its last heartbeat
    window_s: float
    stalled_s: float  # of that, how long the supervisor itself was stalled


def liveness(
    e: Engine, now: float, w: Windows, refused: str | None, stalled_s: float = 0.0
) -> Fence | Overdue | float | None:
    """For a running engine: the reason to fence it now, Overdue once its heartbeat is
    late by `look_s` (a missed beat: the kernel is asked whether it is stopped), or when to
    look again (None: only when something happens). `refused`: why it refused its
    promotion, if it did; `stalled_s`: how much of the time since its last heartbeat the
    supervisor was stalled itself (`pace.LoopPace`)."""
    inc = e.inc
    if inc is None or inc.handled or not e.running or e.state == EngineState.DRAINING:
        return None
    if refused is not None:
        return Fence("promote-refused", refused)
    if not inc.ready and now - inc.started > w.ready_timeout_s:
        return Fence("not-ready", f"not ready within engines.ready_timeout_s={w.ready_timeout_s}")
    if not inc.hello:
        return None
    window = w.silence_s(inc.ready)
    look = min(w.look_s, window) if w.look_s > 0 else window
    if now - e.last_beat > look:
        return Overdue(now - e.last_beat, window, min(stalled_s, now - e.last_beat))
    return e.last_beat + look + 0.001


def judge_silence(
    o: Overdue, sched: SchedState, now: float, w: Windows, ran: bool | None = None
) -> Fence | float:
    """A late engine, by what its threads do (`pace.sched_state`), or when to look again.
    Stopped (SIGSTOP) or gone: fenced as hung now, however little it is late. Otherwise it
    has its window, without the time the supervisor was stalled itself (its heartbeats may
    be waiting unread), looked at every `recheck_s`. Past it, asleep (deadlocked,
    blocked) with its heartbeat thread not given a CPU since its last heartbeat
    (`ran` False, or unknown: None): fenced. Runnable (waiting for a CPU on a busy
    machine, or running), or asleep with its heartbeat thread run since (a heartbeat on
    its way, a wait for the GIL): a busy machine, fenced once silent past
    `busy_silence_s` (without the supervisor's stalls) all the same."""
    ms = round(o.silent_s * 1000, 1)
    own = o.silent_s - o.stalled_s  # the silence the supervisor was there to hear
    stalled = f"; the supervisor was stalled {round(o.stalled_s * 1000, 1)} ms of it" * (
        o.stalled_s > 0
    )
    if sched in ("stopped", "gone"):
        return Fence("hang", f"no heartbeat for {ms} ms, its processes {sched}")
    if own <= o.window_s:
        return now + min(w.recheck_s, o.window_s - own + 0.001)
    if sched == "sleeping" and not ran:
        return Fence("hang", f"no heartbeat for {ms} ms, its processes sleeping{stalled}")
    limit = max(w.busy_silence_s, o.window_s)
    if own > limit:
        why = "runnable" if sched == "runnable" else "its heartbeat thread ran"
        return Fence(
            "hang",
            f"no heartbeat for {ms} ms though {why} (over heartbeat.busy_silence_ms="
            f"{round(w.busy_silence_s * 1000)}){stalled}",
        )
    return now + w.recheck_s


def daemon_hung(
    silent_s: float,
    stalled_s: float,
    sched: SchedState,
    ran: bool,
    deadline_s: float,
    busy_s: float,
) -> str | None:
    """Why a cache daemon that has left its pings unanswered for `silent_s` is hung, or
    None while it may yet answer. Stopped: hung. Gone: its exit is the watch's to see.
    Asleep and not given a CPU since its first unanswered ping (`ran`): hung once silent
    past `deadline_s`, without the time the supervisor was stalled itself
    (`stalled_s`); runnable or run since (a busy machine): past `busy_s`."""
    ms = round(silent_s * 1000, 1)
    own = silent_s - min(stalled_s, silent_s)
    if sched == "stopped":
        return f"no answer for {ms} ms, its process stopped"
    if sched == "gone":
        return None
    if own >= deadline_s and sched == "sleeping" and not ran:
        return f"no answer for {ms} ms, its process sleeping"
    if own >= max(busy_s, deadline_s):
        return f"no answer for {ms} ms though {sched if sched == 'runnable' else 'it ran'}"
    return None


# ---- memory ----
def used_mb(engines: Iterable[Engine]) -> int:
    return sum(e.memory_mb for e in engines if e.running)


def fits(used: int, need: int, cap: int) -> bool:
    """Whether `need` more MB fit beside `used` under devices.memory_mb (0: no limit)."""
    return cap == 0 or used + need <= cap


def eviction_order(engines: Iterable[Engine]) -> list[Engine]:
    """Running batch engines, the first to evict first (lowest priority, newest)."""
    batch = [e for e in engines if not e.serving and e.running]
    return sorted(batch, key=lambda e: (e.priority, -(e.inc.started if e.inc else 0.0)))


def admission_victims(engines: Sequence[Engine], need: int, cap: int) -> list[Engine]:
    """Batch engines to evict, in order, until `need` MB fit; none if it fits already."""
    used = used_mb(engines)
    victims: list[Engine] = []
    for v in eviction_order(engines):
        if fits(used, need, cap):
            break
        victims.append(v)
        used -= v.memory_mb
    return victims


# ---- what the rules want of each engine (`units.Want`); batch engines: evict, respawn ----
RUNS = Want("running", "policy", "the policy runs it")
STOPPING = Want("stopped", "stopping", "the supervisor stops")


@dataclass(frozen=True)
class BatchPlan:
    evict: Engine | None  # one at a time, at most one per heartbeat interval
    start: list[Engine]  # in this order
    due: float | None  # when to plan again, at the latest
    wants: dict[str, Want]  # every engine's, by name, as `BatchGovernor.wants` decided


class BatchGovernor:
    """What the rules want of every engine (`wants`), and the plan that carries it out for
    batch engines (`plan`).

    Serving engines always run, after their restart backoff. Batch engines are evicted
    while the primary's load is over `evict_above` (one per `interval_s`), and none is
    started then, not even a crashed one: one that dies while the load is over
    `evict_above` stays dead until the load is at `evict_above` or under, then comes back
    after its backoff. Evicted ones come back once the load stayed under `respawn_below`
    for `respawn_hold_s`. Either only if it fits `devices.memory_mb` (`cap_mb`) beside
    what runs; ones evicted by hand (`held`) and quarantined ones stay out."""

    def __init__(self, spec: LoadSpec, interval_s: float, cap_mb: int) -> None:
        self.spec = spec
        self.interval_s = interval_s
        self.cap_mb = cap_mb
        self.low_since: float | None = None
        self.last_evict = float("-inf")

    def plan(self, engines: Sequence[Engine], load: int, now: float) -> BatchPlan:
        if load >= self.spec.respawn_below:  # (over evict_above included)
            self.low_since = None
        elif self.low_since is None:
            self.low_since = now
        wants = self.wants(engines, load, now)
        batch = sorted((e for e in engines if not e.serving), key=_start_order)
        start = [e for e in batch if wants[e.name] == RUNS and not e.running]
        due: float | None = None
        for e in batch:
            due = earliest(due, wants[e.name].until)
        evict: Engine | None = None
        if load > self.spec.evict_above:
            victims = eviction_order(engines)
            if victims and now - self.last_evict >= self.interval_s:
                self.last_evict = now
                evict = victims[0]
        return BatchPlan(evict, start, due, wants)

    def wants(self, engines: Sequence[Engine], load: int, now: float) -> dict[str, Want]:
        """Each engine's `Want` now, by name: serving ones first, then batch ones in the
        order memory goes to them: crashed ones before evicted ones, each by priority."""
        out = {e.name: _serving_want(e, now) for e in engines if e.serving}
        used = used_mb(engines)
        for e in sorted((e for e in engines if not e.serving), key=_start_order):
            w = out[e.name] = self._batch_want(e, load, now, used)
            if w == RUNS and not e.running:
                used += e.memory_mb
        return out

    def _batch_want(self, e: Engine, load: int, now: float, used: int) -> Want:
        spec = self.spec
        if e.held:
            return Want("stopped", "held", f"evicted by hand; `supervisor restart {e.name}`")
        if e.state in _SETTLED:
            return _SETTLED[e.state]
        if load > spec.evict_above:
            return Want(
                "stopped",
                "load-high",
                f"load rule: primary load over engines.load.evict_above {spec.evict_above}",
            )
        if e.running:
            return RUNS
        if e.state == EngineState.DEAD and now < e.next_start:
            return Want("running", "backoff", "restart backoff (restart.*)", e.next_start)
        if e.state == EngineState.EVICTED:
            below = f"under engines.load.respawn_below {spec.respawn_below}"
            if load >= spec.respawn_below:
                return Want(
                    "stopped",
                    "load-not-low",
                    f"load rule: evicted; back once the primary load stays {below} for "
                    f"engines.load.respawn_hold_s {spec.respawn_hold_s:g}",
                )
            back = (self.low_since if self.low_since is not None else now) + spec.respawn_hold_s
            if now < back:
                return Want(
                    "running", "respawn-hold", f"load rule: back if the load stays {below}", back
                )
        if not fits(used, e.memory_mb, self.cap_mb):
            cap = f"devices.memory_mb {self.cap_mb}"
            why = f"needs {e.memory_mb} MB beside {used} MB running; {cap}"
            return Want("stopped", "memory-cap", why)
        return RUNS


_QUARANTINED = Want(
    "stopped",
    "quarantined",
    "restarted more than restart.max_restarts in restart.window_s; `supervisor restart`",
)
_SETTLED = {
    EngineState.QUARANTINED: _QUARANTINED,
    EngineState.STOPPED: STOPPING,
    EngineState.DRAINING: Want(
        "stopped", "evicting", "being evicted (SIGTERM, engines.stop_grace_s, SIGKILL)"
    ),
}


def _serving_want(e: Engine, now: float) -> Want:
    """A primary or standby slot runs, after its restart backoff."""
    if e.state in (EngineState.QUARANTINED, EngineState.STOPPED):
        return _SETTLED[e.state]
    if e.state == EngineState.DEAD and now < e.next_start:
        return Want("running", "backoff", "restart backoff (restart.*)", e.next_start)
    return RUNS


def _start_order(e: Engine) -> tuple[bool, int]:
    return e.state != EngineState.DEAD, -e.priority


def load_of(primary: Engine | None) -> int:
    """The primary's load: its requests accepted and not finished (in flight, those waiting
    for KV space included; 0 without a primary)."""
    return primary.in_flight if primary is not None else 0
