"""What a trial waits for: the pool the policy wants now (a table of views), and a pool that
never gets whole again fails its trial with the reason while the run goes on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from chaos.pool import absent_batch, coming_batch, missing, primary_load
from holdfast_contract.control import ClusterStatus, DaemonStatus, EngineStatus
from supervisor.policy import load_policy

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ROOT / "chaos" / "scenarios"
POLICY = load_policy(SCENARIOS / "policy-cpu.yaml")  # evict_above 12, respawn_below 4


def _engine(name: str, role: str, state: str, pid: int, in_flight: int = 0) -> EngineStatus:
    return EngineStatus(name, role, state, pid, 0, 0, None, in_flight=in_flight)


def _daemon(state: str, pid: int) -> DaemonStatus:
    return DaemonStatus(0, state, pid, fingerprint="", pool_bytes=0, adoptions=0)


def _view(load: int, batch_state: str) -> ClusterStatus:
    return ClusterStatus(
        epoch=1,
        primary="e1",
        engines=[
            _engine("e1", "primary", "primary", pid=10, in_flight=load),
            _engine("e2", "standby", "standby", pid=11),
            _engine("batch-1", "batch", batch_state, pid=12 if batch_state == "batch" else 0),
        ],
        daemons=[_daemon("serving", pid=9)],
    )


@pytest.mark.parametrize(
    ("load", "batch_state", "whole", "skip"),
    [
        (0, "batch", True, False),
        (13, "evicted", True, True),  # above evict_above: kept out
        (13, "dead", True, True),  # a crashed one is not restarted above evict_above either
        (6, "evicted", True, True),  # between the thresholds: not yet due back
        (3, "evicted", False, False),  # below respawn_below: due back, wait for it
        (6, "dead", False, False),  # crashed at a modest load: restarted, wait for it
        (0, "starting", False, False),
    ],
)
def test_the_load_rule_decides_whether_a_batch_engine_is_missing(
    load: int, batch_state: str, whole: bool, skip: bool
) -> None:
    view = _view(load, batch_state)
    lacking = missing(view, POLICY)
    assert (not lacking) == whole, lacking
    if not whole:
        assert lacking == [f"batch 0/1 running (batch-1 {batch_state})"]
    assert (absent_batch(view, POLICY) is not None) == skip


@pytest.mark.parametrize(
    ("batch_state", "coming"),
    [("evicted", ["batch-1 evicted"]), ("starting", ["batch-1 starting"]), ("batch", [])],
)
def test_a_batch_engine_evicted_or_starting_is_on_its_way_back(
    batch_state: str, coming: list[str]
) -> None:
    """kill-batch then waits for it (a trial right after memory-pressure found the batch
    engine evicted with the load already low, and must not fail for want of a victim)."""
    assert coming_batch(_view(3, batch_state)) == coming


def test_the_primary_load_is_its_requests_in_flight_queued_ones_included() -> None:
    """The supervisor's rule: queued requests are among those in flight, not added twice."""
    primary = EngineStatus("e1", "primary", "primary", 10, 0, 0, None, in_flight=16, queued=15)
    view = ClusterStatus(epoch=1, primary="e1", engines=[primary], daemons=[])
    assert primary_load(view) == 16


def test_missing_names_every_unit_and_its_state() -> None:
    view = ClusterStatus(
        epoch=2,
        primary=None,
        engines=[_engine("e2", "standby", "starting", pid=11)],
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
def test_a_pool_that_stays_broken_fails_the_trial_with_its_reason_and_the_run_goes_on(
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
    done = subprocess.run(
        [sys.executable, "-m", "chaos", "run", str(tmp_path / "stuck.yaml"), "--out", str(out)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    results = json.loads((out / "results.json").read_text())
    assert done.returncode == 1, done.stdout + done.stderr[-2000:]  # the check fails: no data
    assert results["meta"]["complete"], results["meta"]["note"]
    batch, primary = results["trials"]
    assert batch["outcome"] == "injected" and "pool not whole again" in batch["note"]
    assert primary["outcome"] == "failed"
    assert "ready_timeout_s=4" in primary["note"] and "batch-1" in primary["note"]
    assert results["run"]["failed_trials"] == 1
    assert "waiting" in done.stdout + done.stderr and "batch-1" in done.stdout + done.stderr
