"""A fleet run: build the fleet, run the faults in order, tear it all down, and the figures.

Used by bench/fleet.py (two timing configurations, JSON under bench/results/fleet/) and by
`chaos run` for a scenario with a `fleet:` section (chaos/scenarios/fleet.yaml).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import structlog

from chaos.fleet import analysis
from chaos.fleet.faults import RUNNERS, Ctx, FleetTrial
from chaos.fleet.harness import FleetRun
from chaos.fleet.kinds import FleetConfig
from chaos.fleet.net import FleetError, ns_pids
from chaos.fleet.nodes import NodeOptions

log = structlog.get_logger("chaos.fleet")

MEASURES = (
    "failover_ms",
    "stopped_serving_ms",
    "stepped_down_ms",
    "serve_again_ms",
    "rejoin_ms",
    "overlap_ms",
    "failed_requests",
    "failed_elsewhere",
    "leader_changes",
)


REPAIR_TIMEOUT_S = 120.0


class Step(msgspec.Struct, frozen=True):
    kind: str
    trials: int
    hold_s: float


class FleetResults(msgspec.Struct):
    config: FleetConfig
    trials: list[FleetTrial]
    figures: dict[str, Any]
    errors: list[str]
    rows: int = 0


def make_checkpoint(dest: Path) -> Path:
    """The tiny generated checkpoint every node serves (made once, read by each node's own
    cache daemon)."""
    if not (dest / "model.safetensors").exists():
        subprocess.run(
            [sys.executable, "-m", "cachedaemon", "make-checkpoint", str(dest), "--preset", "tiny"],
            check=True,
            capture_output=True,
        )
    return dest


def run_fleet(
    base: Path,
    config: FleetConfig,
    steps: list[Step],
    *,
    base_policy: dict[str, Any] | None = None,
    on_trial: Callable[[FleetTrial], None] | None = None,
) -> FleetResults:
    opts = NodeOptions(make_checkpoint(base / "checkpoint"), config.ttl_s)
    trials: list[FleetTrial] = []
    errors: list[str] = []
    failed: dict[str, int] = {}  # kind: trials that could not finish
    began = time.monotonic()
    run = FleetRun(
        base,
        opts,
        nodes=config.nodes,
        etcd_flags=config.etcd_flags,
        interval_s=config.client_interval_ms / 1000.0,
        base_policy=base_policy,
    )
    rows: list[Any] = []
    started_ms: float | None = None
    try:
        with run:
            started_ms = analysis.ms(run.started, time.monotonic())
            for step in steps:
                ctx = Ctx(run, step.hold_s, config.observe_s or 1.25 * config.ttl_s)
                for _ in range(step.trials):
                    index = len(trials) + len(errors)
                    try:
                        trial = RUNNERS[step.kind](ctx, index)
                    except FleetError as exc:  # the fleet is repaired and the run goes on
                        errors.append(f"{step.kind} trial {index}: {exc}")
                        failed[step.kind] = failed.get(step.kind, 0) + 1
                        log.error("trial_failed", kind=step.kind, error=str(exc))
                        repaired = run.repair(REPAIR_TIMEOUT_S)
                        errors[-1] += f" (then: {'; '.join(repaired) or 'nothing to repair'})"
                        continue
                    trials.append(trial)
                    if on_trial is not None:
                        on_trial(trial)
            rows = run.clients.since(0)
    except FleetError as exc:
        stage = "the run stopped" if trials or errors else "the fleet could not be started"
        errors.append(f"{stage}: {exc}")
        rows = run.clients.since(0)
    with (base / "responses.jsonl").open("wb") as out:  # every response, for a post-mortem
        for row in rows:
            out.write(msgspec.json.encode(msgspec.structs.asdict(row)) + b"\n")
    left = [f"{ns}: {ns_pids(ns)}" for ns in _namespaces()]
    figures = _figures(trials, rows, started_ms, time.monotonic() - began)
    figures["left_behind"] = left
    figures["failed_trials"] = failed
    return FleetResults(config, trials, figures, errors, len(rows))


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith("hf-")]


def _figures(
    trials: list[FleetTrial], rows: list[Any], started_ms: float | None, wall_s: float
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "wall_s": round(wall_s, 1),
        "first_leader_ms": started_ms,
        "requests": len(rows),
        "answered_ok": sum(1 for r in rows if r.ok),
        "overlap_ms_whole_run": analysis.overlap_ms(rows),
        "epochs_answered_by_two_nodes": sum(
            1 for nodes in analysis.epoch_nodes(rows).values() if len(nodes) > 1
        ),
        "per_fault": {},
    }
    for kind in dict.fromkeys(t.kind for t in trials):
        mine = [t for t in trials if t.kind == kind]
        per: dict[str, Any] = {"trials": len(mine)}
        for measure in MEASURES:
            values = [getattr(t, measure) for t in mine]
            if any(v is not None for v in values):
                per[measure] = analysis.summary([None if v is None else float(v) for v in values])
        for led, label in ((False, "raft_follower_killed"), (True, "raft_leader_killed")):
            which = [t for t in mine if t.etcd_leader is led]
            if which:
                per[label] = {
                    "trials": len(which),
                    "leader_changes": sum(t.leader_changes for t in which),
                    "failed_requests": sum(t.failed_requests for t in which),
                }
        for flag in ("leader_kept", "own_cache"):
            seen = [v for t in mine if (v := getattr(t, flag)) is not None]
            if seen:
                per[flag] = f"{sum(seen)} of {len(seen)}"
        out["per_fault"][kind] = per
    return out
