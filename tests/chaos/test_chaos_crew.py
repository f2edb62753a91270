"""What a trial waits for: the crew the policy wants now, as the supervisor's rules say it
(a table of engines run through its decisions), and a crew that never gets whole again
fails its trial with the reason while the run goes on."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from chaos.crew import absent_batch, coming_batch, kept_out, missing
from holdfast_contract.control import CrewStatus, DaemonStatus, EngineStatus
from supervisor.backoff import RestartBook
from supervisor.decisions import BatchGovernor, load_of
from supervisor.policy_file import load_policy
from supervisor.states import EngineState
from supervisor.units import Engine, Incarnation
from tests.conftest import chaos_run
from tests.supervisor_fakes import FakeProc

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = ROOT / "chaos" / "scenarios"
POLICY = load_policy(SCENARIOS / "policy-cpu.yaml")  # evict_above 12, respawn_below 4
E = EngineState
WALL = 1_800_000_000.0  # the wall clock at monotonic 0


def _unit(name: str, role: str, state: EngineState, **kw: object) -> Engine:
    batch = role == "batch"
    kw.setdefault("memory_mb", POLICY.engines.batch[0].memory_mb if batch else 0)
    e = Engine(
        name=name,
        group="batch" if batch else "serving",
        role=role,
        book=RestartBook(POLICY.restart),
        state=state,
        **kw,  # type: ignore[arg-type]
    )
    if e.running:
        e.inc = Incarnation([FakeProc()], ready=state != E.STARTING)
    return e


def _decided(
    load: int, batch_state: EngineState, cap_mb: int = POLICY.devices.memory_mb, **batch: object
) -> CrewStatus:
    """The supervisor's view at t=10 of a primary at `load`, a standby and one batch engine,
    each with what the rules want of it (the load as it is since t=9), under a memory cap
    of `cap_mb` (0: none, as in the policy)."""
    units = [
        _unit("e1", "primary", E.PRIMARY, in_flight=load),
        _unit("e2", "standby", E.STANDBY),
        _unit("batch-1", "batch", batch_state, **batch),
    ]
    rules = BatchGovernor(POLICY.engines.load, 0.1, cap_mb)
    for now in (9.0, 10.0):
        plan = rules.plan(units, load_of(units[0]), now)
    for e in units:
        e.wanted = plan.wants[e.name]
    return CrewStatus(
        epoch=1,
        primary="e1",
        engines=[e.status(10.0, WALL + 10.0) for e in units],
        daemons=[_daemon("serving", pid=9)],
    )


def _daemon(state: str, pid: int) -> DaemonStatus:
    return DaemonStatus(0, state, pid, fingerprint="", pool_bytes=0, adoptions=0)


@pytest.mark.parametrize(
    ("load", "batch_state", "batch", "whole", "skip"),
    [
        (0, E.BATCH, {}, True, False),
        (13, E.BATCH, {}, True, True),  # above evict_above: being evicted
        (13, E.EVICTED, {}, True, True),  # kept out
        (13, E.DEAD, {}, True, True),  # a crashed one is not restarted above evict_above
        (6, E.EVICTED, {}, True, True),  # between the thresholds: not yet due back
        (3, E.EVICTED, {}, False, False),  # below respawn_below: due back, wait for it
        (3, E.EVICTED, {"held": True}, True, True),  # evicted by hand: stays out
        (6, E.DEAD, {}, False, False),  # crashed at a modest load: restarted, wait for it
        (6, E.DEAD, {"next_start": 11.0}, False, False),  # (after its backoff)
        (0, E.STARTING, {}, False, False),
        (0, E.QUARANTINED, {}, False, False),  # lost: the crew is not whole
    ],
)
def test_the_supervisors_wants_decide_whether_a_batch_engine_is_missing(
    load: int, batch_state: EngineState, batch: dict[str, object], whole: bool, skip: bool
) -> None:
    view = _decided(load, batch_state, **batch)
    lacking = missing(view, POLICY)
    assert (not lacking) == whole, lacking
    if not whole:
        assert lacking == [f"batch 0/1 running (batch-1 {batch_state})"]
    assert (absent_batch(view) is not None) == skip


@pytest.mark.parametrize("load", [0, 3, 4, 6, 12, 13])
@pytest.mark.parametrize("batch_state", [E.DEAD, E.EVICTED, E.STARTING, E.BATCH])
@pytest.mark.parametrize("held", [False, True])
def test_chaos_reads_kept_out_exactly_where_the_rules_want_a_batch_engine_stopped(
    load: int, batch_state: EngineState, held: bool
) -> None:
    view = _decided(load, batch_state, held=held and batch_state == E.EVICTED)
    status = view.engine("batch-1")
    assert status is not None and status.wanted is not None
    reason = kept_out(status)
    assert (reason is None) == (status.wanted.state == "running"), status.wanted
    if reason is not None:
        assert status.wanted.reason in reason and status.wanted.detail in reason


def test_a_memory_cap_keeps_a_batch_engine_out_and_says_so() -> None:
    view = _decided(0, E.DEAD, cap_mb=50)  # its 64 MB do not fit
    batch = view.engine("batch-1")
    assert batch is not None
    assert kept_out(batch) == "memory-cap: needs 64 MB beside 0 MB running; devices.memory_mb 50"
    assert not missing(view, POLICY)
    assert absent_batch(view) is not None


def test_a_backoff_is_published_with_its_end_on_the_wall_clock() -> None:
    view = _decided(6, E.DEAD, next_start=11.5)
    batch = view.engine("batch-1")
    assert batch is not None and batch.wanted is not None
    assert (batch.wanted.reason, batch.wanted.until) == ("backoff", WALL + 11.5)
    assert coming_batch(view) == ["batch-1 dead"]


@pytest.mark.parametrize(
    ("load", "batch_state", "coming"),
    [
        (3, E.EVICTED, ["batch-1 evicted"]),  # below respawn_below: back after the hold
        (6, E.EVICTED, []),  # kept out
        (0, E.STARTING, ["batch-1 starting"]),
        (0, E.BATCH, []),
    ],
)
def test_a_batch_engine_wanted_back_or_starting_is_on_its_way(
    load: int, batch_state: EngineState, coming: list[str]
) -> None:
    """kill-batch then waits for it (a trial right after memory-pressure found the batch
    engine evicted with the load already low, and must not fail for want of a victim)."""
    assert coming_batch(_decided(load, batch_state)) == coming


def test_missing_names_every_unit_and_its_state() -> None:
    view = CrewStatus(
        epoch=2,
        primary=None,
        engines=[EngineStatus("e2", "standby", "starting", 11, 0, 0, None)],
        daemons=[_daemon("reclaiming", pid=0)],
    )
    assert missing(view, POLICY) == [
        "a primary (none serving)",
        "standby 0/1 ready (e2 starting)",
        "daemon 0 reclaiming",
    ]


SCENARIO = """
name: stuck
trials: 1
warmup_s: 0.5
settle_s: 0.1
trial_timeout_s: 6
ready_timeout_s: 4
start_timeout_s: 90
load: {concurrency: 2, rate: 20, max_tokens: 2}
stages:
  - name: main
    policy: policy.yaml
    faults:
      - {kind: kill-batch}
      - {kind: kill-primary}
checks:
  - "kill-primary.promotion_ms.max < 1000"
"""


@pytest.mark.slow
def test_a_crew_that_stays_broken_fails_the_trial_with_its_reason_and_the_run_goes_on(
    tmp_path: Path,
) -> None:
    policy = yaml.safe_load((SCENARIOS / "policy-cpu.yaml").read_text())
    marker = tmp_path / "started-once"
    # the batch engine starts once; every restart after the kill exits at once
    policy["engines"]["batch"][0]["command"] = [
        "sh",
        "-c",
        f"test -e {marker} && exit 3; touch {marker}; exec {{python}} -m engine",
    ]
    (tmp_path / "policy.yaml").write_text(yaml.safe_dump(policy))
    (tmp_path / "stuck.yaml").write_text(SCENARIO)
    out = tmp_path / "out"
    done, results = chaos_run(tmp_path / "stuck.yaml", out)
    assert done.returncode == 1, done.stdout + done.stderr[-2000:]  # the check fails: no data
    assert results["meta"]["complete"], results["meta"]["note"]
    batch, primary = results["trials"]
    assert batch["outcome"] == "injected" and "pool not whole again" in batch["note"]
    assert primary["outcome"] == "failed"
    assert "ready_timeout_s=4" in primary["note"] and "batch-1" in primary["note"]
    assert results["run"]["failed_trials"] == 1
    assert "waiting" in done.stdout + done.stderr and "batch-1" in done.stdout + done.stderr
