"""`chaos run` of a scenario with a `fleet:` section: each stage builds a fleet with the
stage's policy as every node's base, runs the stage's faults in the drawn order through
the fleet harness (chaos/fleet/), and the scenario's checks are evaluated on its trials.
Writes results.json and report.md in --out; the exit code is the chaos suite's.
"""

from __future__ import annotations

import math
import shutil
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec

from chaos.checks import Check
from chaos.fleet.faults import FleetTrial
from chaos.fleet.kinds import MEASURED_BY, FleetConfig
from chaos.fleet.run import FleetResults, Step, run_fleet
from chaos.metrics import CheckResult, stat
from chaos.report import machine
from chaos.scenario import Plan
from chaos.stagepolicy import policy_data


class FleetReport(msgspec.Struct):
    scenario: str
    command: str
    date: str
    machine: str
    checks: list[CheckResult]
    stages: dict[str, FleetResults]


def run_scenario(plan: Plan, command: str, out: Path) -> tuple[FleetReport, bool]:
    """The report, and whether every check passed with every stage complete."""
    config = plan.scenario.fleet or FleetConfig()
    started = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    stages: dict[str, FleetResults] = {}
    for stage, faults in zip(plan.scenario.stages, plan.order, strict=True):
        base = policy_data(plan.policy_path(stage), stage.policy_overrides)
        steps = [Step(f.kind, 1, f.hold_s) for f in faults]
        with tempfile.TemporaryDirectory(prefix="hf-fleet-") as tmp:
            stages[stage.name] = run_fleet(Path(tmp), config, steps, base_policy=base)
            keep = out / stage.name  # what each node ran and said, as the single-node runner
            keep.mkdir(parents=True, exist_ok=True)
            for node in sorted(Path(tmp).glob("n*/")):
                for name in ("policy.yaml", "supervisor.log"):
                    if (node / name).exists():
                        shutil.copy2(node / name, keep / f"{node.name}-{name}")
    trials = [t for r in stages.values() for t in r.trials]
    checks = [evaluate(c, trials, stages) for c in plan.checks]
    report = FleetReport(plan.scenario.name, command, started, machine(), checks, stages)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_bytes(msgspec.json.format(msgspec.json.encode(report)))
    (out / "report.md").write_text(markdown(report))
    complete = all(not r.errors and not r.figures["left_behind"] for r in stages.values())
    return report, complete and all(c.passed for c in checks)


def evaluate(
    check: Check, trials: list[FleetTrial], stages: dict[str, FleetResults]
) -> CheckResult:
    """A check on the trials (or the run); no trial in scope is no pass, and a trial that
    should have measured the metric and did not counts as infinity."""
    value: float | None
    if check.stat is None:
        value = float(_run_figure(check.metric, trials, stages))
    else:
        kinds = MEASURED_BY.get(check.metric)
        scoped = [
            t
            for t in trials
            if (check.scope is None or t.kind == check.scope) and (kinds is None or t.kind in kinds)
        ]
        data = [math.inf if (v := getattr(t, check.metric)) is None else float(v) for t in scoped]
        value = stat(data, check.stat)
    return CheckResult(check.text, value, check.holds(value))


def _run_figure(metric: str, trials: list[FleetTrial], stages: dict[str, FleetResults]) -> int:
    if metric == "requests":
        return sum(r.rows for r in stages.values())
    if metric == "failed_requests":
        return sum(t.failed_requests for t in trials)
    return sum(len(r.figures["left_behind"]) for r in stages.values())  # lingering_processes


def markdown(report: FleetReport) -> str:
    lines = [f"# Fleet chaos: {report.scenario}", "", f"`{report.command}`", ""]
    lines += [f"{report.date} on {report.machine}", "", "## Checks", ""]
    lines += [
        f"- {'pass' if c.passed else 'FAIL'} `{c.check}` (value {c.value})" for c in report.checks
    ]
    for name, results in report.stages.items():
        lines += ["", f"## Stage {name} (ttl_s {results.config.ttl_s})", ""]
        lines += [f"- error: {e}" for e in results.errors]
        lines += ["| # | fault | victim | leader before -> after | failover ms | stopped serving ms "
                  "| rejoin ms | failed | overlap ms |", "|" + " --- |" * 9]  # fmt: skip
        for t in results.trials:
            lines.append(
                f"| {t.index} | {t.kind} | {t.victim}{' (raft leader)' if t.etcd_leader else ''} | "
                f"{t.old_leader}@{t.old_epoch} -> "
                f"{t.new_leader}@{t.new_epoch} | {_num(t.failover_ms)} | "
                f"{_num(t.stopped_serving_ms)} | {_num(t.rejoin_ms)} | {t.failed_requests} | "
                f"{t.overlap_ms} |"
            )
    return "\n".join(lines) + "\n"


def _num(value: Any) -> str:
    return "-" if value is None else f"{value:g}"
