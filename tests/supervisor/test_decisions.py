"""The supervisor's decisions, table by table, on a fake clock and fake process handles:
whom to promote, when to fence, which batch engine leaves and when it comes back, restart
backoff and intensity, and where the router sends a request."""

from __future__ import annotations

import pytest

from holdfast_contract.control import Wanted
from supervisor.backoff import Backoff, RestartBook
from supervisor.decisions import (
    RUNS,
    BatchGovernor,
    Fence,
    Overdue,
    Windows,
    admission_victims,
    best_standby,
    earliest,
    eviction_order,
    fits,
    liveness,
    load_of,
)
from supervisor.policy import LoadSpec, RestartSpec, RouterSpec
from supervisor.primary import Target, choose
from supervisor.proxy.routing import attempts
from supervisor.states import EngineState
from supervisor.units import Engine, Incarnation, Want
from tests.supervisor_fakes import FakeProc

E = EngineState
HANG = 0.5  # heartbeat window once ready
W = Windows(
    ready_timeout_s=10.0, hang_s=HANG, starting_silence_s=5.0, busy_silence_s=2.0, recheck_s=0.025
)


def engine(
    name: str = "e1",
    state: EngineState = E.STANDBY,
    *,
    batch: bool = False,
    beat: float = 0.0,
    in_flight: int = 0,
    started: float = 0.0,
    ready: bool = True,
    hello: bool = True,
    handled: bool = False,
    priority: int = 0,
    memory_mb: int = 0,
    held: bool = False,
    next_start: float = 0.0,
    inc: bool = True,
) -> Engine:
    running = state not in (E.DEAD, E.EVICTED, E.QUARANTINED, E.STOPPED)
    return Engine(
        name=name,
        group="b" if batch else "serving",
        role="batch" if batch else "standby",
        book=RestartBook(RestartSpec()),
        priority=priority,
        memory_mb=memory_mb,
        state=state,
        inc=Incarnation([FakeProc()], started=started, handled=handled, hello=hello, ready=ready)
        if inc and running
        else None,
        last_beat=beat,
        in_flight=in_flight,
        held=held,
        next_start=next_start,
    )


# ---- promotion ----
@pytest.mark.parametrize(
    ("engines", "now", "expected"),
    [
        ([], 1.0, None),
        ([engine("e1", beat=1.0)], 1.2, "e1"),
        ([engine("e1", beat=1.0)], 1.0 + HANG, None),  # silent for the whole window: not
        ([engine("e1", beat=1.0)], 1.0 + HANG - 0.001, "e1"),
        ([engine("e1", E.STARTING, beat=1.0)], 1.1, None),
        ([engine("e1", E.PRIMARY, beat=1.0)], 1.1, None),
        ([engine("e1", E.BATCH, batch=True, beat=1.0)], 1.1, None),
        ([engine("e1", beat=1.0, handled=True)], 1.1, None),  # being fenced
        ([engine("e1", beat=1.0, in_flight=2), engine("e2", beat=1.0, in_flight=1)], 1.1, "e2"),
        ([engine("e1", beat=0.9), engine("e2", beat=1.0)], 1.1, "e2"),  # heard from last
        ([engine("e1", beat=1.0, in_flight=0), engine("e2", beat=1.05, in_flight=3)], 1.1, "e1"),
    ],
    ids=[
        "none",
        "fresh",
        "silent-window",
        "just-inside",
        "starting",
        "primary",
        "batch",
        "handled",
        "least-loaded",
        "freshest",
        "load-before-freshness",
    ],
)
def test_best_standby(engines: list[Engine], now: float, expected: str | None) -> None:
    chosen = best_standby(engines, now, HANG)
    assert (chosen.name if chosen else None) == expected


# ---- liveness ----
@pytest.mark.parametrize(
    ("e", "now", "refused", "expected"),
    [
        # not ready within ready_timeout_s: fenced, whether it said hello or not
        (engine("e1", E.STARTING, ready=False, hello=False, started=0.0), 10.0, None, None),
        (
            engine("e1", E.STARTING, ready=False, hello=False, started=0.0),
            10.001,
            None,
            Fence("not-ready", "not ready within engines.ready_timeout_s=10.0"),
        ),
        # starting and heard from: the starting window (starting_silence_s) applies
        (engine("e1", E.STARTING, ready=False, beat=1.0), 5.9, None, 1.0 + 5.0 + 0.001),
        (
            engine("e1", E.STARTING, ready=False, beat=1.0),
            6.01,
            None,
            Overdue(6.01 - 1.0, 5.0, 0.0),
        ),
        # ready: the miss window (interval x miss_limit)
        (engine(beat=1.0), 1.5, None, 1.0 + HANG + 0.001),
        (engine(beat=1.0), 1.51, None, Overdue(1.51 - 1.0, HANG, 0.0)),
        (
            engine("e1", E.PRIMARY, beat=1.0),
            1.1,
            "bad epoch",
            Fence("promote-refused", "bad epoch"),
        ),
        # nothing to watch
        (engine("e1", E.DRAINING, beat=1.0, batch=True), 99.0, None, None),
        (engine(beat=1.0, handled=True), 99.0, None, None),
        (engine("e1", E.DEAD), 99.0, None, None),
        (
            engine("e1", E.STARTING, ready=False, hello=False, started=5.0),
            6.0,
            None,
            None,
        ),  # no hello yet
    ],
    ids=[
        "ready-timeout-edge",
        "ready-timeout",
        "starting-quiet",
        "starting-silent",
        "ready-quiet",
        "ready-silent",
        "refused",
        "draining",
        "handled",
        "dead",
        "no-hello",
    ],
)
def test_liveness(e: Engine, now: float, refused: str | None, expected: object) -> None:
    assert liveness(e, now, W, refused) == expected


def test_the_starting_window_is_never_shorter_than_the_ready_one() -> None:
    w = Windows(
        ready_timeout_s=1.0, hang_s=2.0, starting_silence_s=0.5, busy_silence_s=2.0, recheck_s=0.1
    )
    assert (w.silence_s(ready=False), w.silence_s(ready=True)) == (2.0, 2.0)
    assert (W.silence_s(ready=False), W.silence_s(ready=True)) == (5.0, HANG)


# ---- memory and eviction order ----
@pytest.mark.parametrize(
    ("used", "need", "cap", "ok"),
    [(0, 10, 0, True), (90, 10, 100, True), (91, 10, 100, False), (0, 101, 100, False)],
)
def test_fits(used: int, need: int, cap: int, ok: bool) -> None:
    assert fits(used, need, cap) is ok


def test_eviction_order_is_lowest_priority_then_newest() -> None:
    old_low = engine("a", E.BATCH, batch=True, priority=0, started=1.0)
    new_low = engine("b", E.BATCH, batch=True, priority=0, started=2.0)
    high = engine("c", E.STARTING, batch=True, priority=5, started=3.0)
    gone = engine("d", E.EVICTED, batch=True, priority=-1)
    serving = engine("e1", E.PRIMARY)
    order = eviction_order([old_low, high, serving, gone, new_low])
    assert [e.name for e in order] == ["b", "a", "c"]


@pytest.mark.parametrize(
    ("need", "cap", "expected"),
    [(10, 0, []), (10, 100, []), (30, 100, ["b"]), (50, 100, ["b", "a"]), (500, 100, ["b", "a"])],
)
def test_admission_evicts_until_it_fits(need: int, cap: int, expected: list[str]) -> None:
    engines = [
        engine("e1", E.PRIMARY, memory_mb=50),
        engine("a", E.BATCH, batch=True, priority=1, memory_mb=20),
        engine("b", E.BATCH, batch=True, priority=0, memory_mb=20),
    ]  # 90 of 100 MB used
    assert [v.name for v in admission_victims(engines, need, cap)] == expected


# ---- batch: eviction under load, respawn with hysteresis ----
SPEC = LoadSpec(evict_above=4, respawn_below=2, respawn_hold_s=1.0)
INTERVAL = 0.1


def governor(cap: int = 0) -> BatchGovernor:
    return BatchGovernor(SPEC, INTERVAL, cap)


def test_load_over_evict_above_evicts_one_per_interval() -> None:
    g = governor()
    a = engine("a", E.BATCH, batch=True, priority=1)
    b = engine("b", E.BATCH, batch=True, priority=0)
    assert g.plan([a, b], load=4, now=10.0).evict is None  # at the threshold: stays
    assert g.plan([a, b], load=5, now=10.0).evict is b
    assert g.plan([a, b], load=5, now=10.05).evict is None  # within one interval
    assert g.plan([a, b], load=5, now=10.2).evict is b  # (b is still running here)
    assert g.plan([], load=9, now=20.0) == g.plan([], load=9, now=30.0)


@pytest.mark.parametrize(
    ("loads", "expected"),
    [
        # (now, load) steps after an eviction at t=0; the plan's start list at the last one
        ([(0.0, 1), (0.99, 1)], []),
        ([(0.0, 1), (1.0, 1)], ["a"]),  # low for respawn_hold_s
        ([(0.0, 1), (0.5, 2), (1.0, 1), (1.9, 1)], []),  # a load at respawn_below resets it
        ([(0.0, 1), (0.5, 2), (1.0, 1), (2.0, 1)], ["a"]),
        ([(0.0, 1), (0.5, 5), (1.0, 1), (1.5, 1)], []),  # over evict_above resets it too
    ],
    ids=["hold", "held-long-enough", "reset-at-threshold", "after-reset", "reset-by-load"],
)
def test_evicted_engines_come_back_after_low_load_for_the_hold(
    loads: list[tuple[float, int]], expected: list[str]
) -> None:
    g = governor()
    a = engine("a", E.EVICTED, batch=True)
    plan = None
    for now, load in loads:
        plan = g.plan([a], load, now)
    assert plan is not None and [e.name for e in plan.start] == expected


def test_while_holding_the_plan_says_when_to_look_again() -> None:
    g = governor()
    a = engine("a", E.EVICTED, batch=True)
    assert g.plan([a], load=0, now=3.0).due == 4.0
    assert g.plan([a], load=0, now=3.5).due == 4.0


def test_held_engines_stay_out_and_crashed_ones_return_after_their_backoff() -> None:
    g = governor()
    held = engine("h", E.EVICTED, batch=True, held=True)
    crashed = engine("c", E.DEAD, batch=True, next_start=5.0)
    assert g.plan([held, crashed], load=3, now=4.0).start == []
    assert g.plan([held, crashed], load=3, now=4.0).due == 5.0
    assert g.plan([held, crashed], load=3, now=5.0).start == [crashed]  # whatever the load
    assert g.plan([held, crashed], load=0, now=99.0).start == [crashed]
    assert g.plan([crashed], load=5, now=99.0).start == []  # not while evicting


def test_starts_follow_priority_and_memory() -> None:
    g = governor(cap=100)
    serving = engine("e1", E.PRIMARY, memory_mb=40)
    low = engine("low", E.EVICTED, batch=True, priority=0, memory_mb=30)
    high = engine("high", E.EVICTED, batch=True, priority=9, memory_mb=50)
    g.plan([serving, low, high], load=0, now=0.0)
    plan = g.plan([serving, low, high], load=0, now=1.0)
    assert [e.name for e in plan.start] == ["high"]  # 40 + 50 used; 30 more do not fit


# ---- what the rules want of each engine ----
CAP = 100  # MB; the primary uses 40


@pytest.mark.parametrize(
    ("state", "load", "kw", "expected"),
    [
        (E.BATCH, 3, {}, ("running", "policy", None)),
        (E.STARTING, 4, {}, ("running", "policy", None)),  # at evict_above: stays
        (E.BATCH, 5, {}, ("stopped", "load-high", None)),  # over it: evicted
        (E.DEAD, 3, {"next_start": 12.0}, ("running", "backoff", 12.0)),
        (E.DEAD, 3, {}, ("running", "policy", None)),  # its backoff over: started now
        (E.DEAD, 5, {}, ("stopped", "load-high", None)),  # not restarted while evicting
        (E.DEAD, 5, {"next_start": 12.0}, ("stopped", "load-high", None)),
        (E.DEAD, 3, {"memory_mb": 70}, ("stopped", "memory-cap", None)),  # 40 + 70 > 100
        (E.DEAD, 3, {"memory_mb": 60}, ("running", "policy", None)),
        (E.EVICTED, 2, {}, ("stopped", "load-not-low", None)),  # at respawn_below
        (E.EVICTED, 1, {}, ("running", "respawn-hold", 11.0)),  # low since 10.0
        (E.EVICTED, 1, {"held": True}, ("stopped", "held", None)),
        (E.EVICTED, 1, {"memory_mb": 70}, ("running", "respawn-hold", 11.0)),  # memory: once held
        (E.QUARANTINED, 0, {}, ("stopped", "quarantined", None)),
        (E.DRAINING, 0, {}, ("stopped", "evicting", None)),
        (E.STOPPED, 0, {}, ("stopped", "stopping", None)),
    ],
)
def test_what_the_rules_want_of_a_batch_engine(
    state: EngineState, load: int, kw: dict[str, object], expected: tuple[object, ...]
) -> None:
    """One plan at t=10 (the load low since then, if low): the engine's want, and the
    plan carries it out: started now exactly when wanted running with nothing to wait
    for, looked at again when its reason ends."""
    g = governor(cap=CAP)
    primary = engine("e1", E.PRIMARY, in_flight=load, memory_mb=40)
    b = engine("b", state, batch=True, **kw)  # type: ignore[arg-type]
    plan = g.plan([primary, b], load, now=10.0)
    w = plan.wants["b"]
    assert (w.state, w.reason, w.until) == expected, w
    assert w.detail
    assert plan.start == ([b] if w.reason == "policy" and not b.running else [])
    assert plan.due == w.until
    assert plan.wants["e1"].reason == "policy"  # a serving engine runs whatever the load


@pytest.mark.parametrize(("state", "next_start"), [(E.DEAD, 12.0), (E.EVICTED, 0.0)])
def test_an_engine_wanted_running_later_is_started_when_its_reason_ends(
    state: EngineState, next_start: float
) -> None:
    g = governor()
    b = engine("b", state, batch=True, next_start=next_start)
    w = g.plan([b], load=1, now=10.0).wants["b"]
    assert w.state == "running" and w.until is not None
    assert g.plan([b], load=1, now=w.until - 0.001).start == []
    plan = g.plan([b], load=1, now=w.until)
    assert plan.start == [b] and plan.wants["b"].reason == "policy"


def test_memory_goes_to_crashed_engines_before_evicted_ones_by_priority() -> None:
    g = governor(cap=100)
    primary = engine("e1", E.PRIMARY, memory_mb=40)
    evicted = engine("ev", E.EVICTED, batch=True, priority=9, memory_mb=30)
    low = engine("low", E.DEAD, batch=True, priority=0, memory_mb=30)
    high = engine("high", E.DEAD, batch=True, priority=5, memory_mb=30)
    g.plan([primary, evicted, low, high], load=0, now=0.0)
    plan = g.plan([primary, evicted, low, high], load=0, now=5.0)
    assert [e.name for e in plan.start] == ["high", "low"]
    w = plan.wants["ev"]
    assert (w.state, w.reason) == ("stopped", "memory-cap")
    assert w.detail == "needs 30 MB beside 100 MB running; devices.memory_mb 100"


def test_serving_engines_run_after_their_backoff_unless_quarantined() -> None:
    g = governor()
    dead = engine("e2", E.DEAD, next_start=12.0)
    q = engine("e3", E.QUARANTINED)
    wants = g.plan([dead, q], load=99, now=10.0).wants
    assert (wants["e2"].reason, wants["e2"].until) == ("backoff", 12.0)
    assert (wants["e3"].state, wants["e3"].reason) == ("stopped", "quarantined")
    assert g.plan([dead], load=99, now=12.0).wants["e2"] == RUNS


def test_a_want_is_published_on_the_wall_clock() -> None:
    w = Want("running", "backoff", "restart backoff", until=12.5)
    assert w.wire(now=10.0, wall=1_000.0) == Wanted(
        "running", "backoff", "restart backoff", 1_002.5
    )
    assert RUNS.wire(10.0, 1_000.0).until is None


def test_load_of_the_primary() -> None:
    p = engine("e1", E.PRIMARY, in_flight=3)
    p.queued = 2  # of the 3 in flight: not counted twice
    assert (load_of(p), load_of(None)) == (3, 0)
    assert (earliest(None, 2.0), earliest(1.0, None), earliest(3.0, 2.0)) == (2.0, 1.0, 2.0)


# ---- restart intensity and backoff ----
@pytest.mark.parametrize(
    ("attempt", "rand", "expected"),
    [
        (0, 0.0, 0.1),
        (1, 0.0, 0.1),
        (2, 0.0, 0.2),
        (3, 0.0, 0.4),
        (5, 0.0, 1.0),  # 1.6, capped
        (3, 1.0, 0.45),  # plus the whole jitter
        (10_000, 0.5, 1.025),  # overflows: the cap
    ],
)
def test_backoff_is_exponential_capped_with_jitter(
    attempt: int, rand: float, expected: float
) -> None:
    b = Backoff(initial=0.1, cap=1.0, base=2.0, jitter=0.05)
    assert b.delay(attempt, lambda: rand) == pytest.approx(expected)


def test_restart_book_counts_restarts_in_the_window_and_quarantines_past_the_limit() -> None:
    spec = RestartSpec(initial_s=0.1, max_s=1.0, multiplier=2.0, jitter_s=0.0, max_restarts=2)
    book = RestartBook(spec, rand=lambda: 0.0)
    assert book.delay(now=0.0) == pytest.approx(0.1)  # none yet: as the first
    assert [book.record(now=t) for t in (0.0, 1.0)] == [False, False]
    assert book.delay(now=1.0) == pytest.approx(0.2)
    assert book.record(now=2.0) is True  # the third within window_s
    assert book.recent(now=60.0) == 3  # exactly window_s after the first: still inside
    assert book.recent(now=60.001) == 2
    book.reset()
    assert (book.recent(now=60.0), book.total) == (0, 3)


# ---- router ----
T1, T2 = Target("e1", 9000, 1), Target("e2", 9001, 2)


@pytest.mark.parametrize(
    ("current", "after", "expected"),
    [
        (None, -1, None),  # no primary: wait for one
        (T1, -1, T1),  # the first attempt goes to the current primary
        (T1, 1, None),  # the retry never goes back to the primary that failed
        (T2, 1, T2),  # ... but to the next one
        (T1, 2, None),  # nor to an older one
    ],
)
def test_router_choice(current: Target | None, after: int, expected: Target | None) -> None:
    assert choose(current, after) == expected


def test_router_attempts() -> None:
    assert (attempts(RouterSpec(retry=True)), attempts(RouterSpec(retry=False))) == (2, 1)
