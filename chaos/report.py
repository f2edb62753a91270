"""The run's report: report.md (a table per fault), results.json (every raw row), plots."""

from __future__ import annotations

import math
import os
import platform
import socket
from collections.abc import Sequence
from pathlib import Path

import msgspec

from chaos.load import RequestRow
from chaos.metrics import COUNTS, MS_METRICS, CheckResult, RunFigures, TrialRow, stat, values
from chaos.recorder import EventRow

STATS = ("p50", "p95", "p99", "max")


class RunMeta(msgspec.Struct, frozen=True):
    scenario: str
    command: str
    started: str  # ISO 8601, UTC
    finished: str
    machine: str
    complete: bool  # False when the run was interrupted or a stage failed to start
    note: str = ""


class Results(msgspec.Struct, frozen=True):
    meta: RunMeta
    run: RunFigures
    checks: list[CheckResult]
    trials: list[TrialRow]
    requests: list[RequestRow]
    events: list[EventRow]


def machine() -> str:
    """Host, architecture, usable CPUs and memory, Python: enough to compare two runs."""
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"{socket.gethostname()} {platform.machine()} cpus={len(os.sched_getaffinity(0))} "
        f"mem={mem_gib:.0f}GiB python={platform.python_version()}"
    )


def write(out: Path, results: Results) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_bytes(msgspec.json.encode(results))
    (out / "report.md").write_text(markdown(results))


def markdown(results: Results) -> str:
    meta, run = results.meta, results.run
    lines = [
        f"# chaos report: {meta.scenario}",
        "",
        f"- command: `{meta.command}`",
        f"- started {meta.started}, finished {meta.finished}",
        f"- machine: {meta.machine}",
        f"- complete: {'yes' if meta.complete else 'no (partial)'}"
        + (f" — {meta.note}" if meta.note else ""),
        "",
        "## Whole run",
        "",
        "| faults | requests | failed | retried | availability | baseline p50 ms | lingering processes |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| {run.faults} | {run.requests} | {run.failed_requests} | {run.retried_requests} "
        f"| {_pct(run.availability)} | {_num(run.baseline_p50_ms)} | {run.lingering_processes} |",
        "",
        "## Checks",
        "",
        "| check | value | result |",
        "| --- | ---: | --- |",
        *[
            f"| `{c.check}` | {_num(c.value)} | {'pass' if c.passed else '**FAIL**'} |"
            for c in results.checks
        ],
        "",
        "## Per fault",
        "",
        "Times in ms from the moment the fault was injected; `timeout` means the trial ended "
        "without it. Counts are requests per trial.",
    ]
    for fault in sorted({t.fault for t in results.trials}):
        lines += ["", *_fault_table(fault, [t for t in results.trials if t.fault == fault])]
    lines += ["", "## Plots", "", "![timeline](timeline.png)", "", "![recovery](recovery.png)", ""]
    return "\n".join(lines)


def _fault_table(fault: str, trials: Sequence[TrialRow]) -> list[str]:
    lines = [
        f"### {fault} ({len(trials)} trials)",
        "",
        "| metric | n | p50 | p95 | p99 | max |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for metric in (*MS_METRICS, *COUNTS):
        data = values(trials, metric)
        if not data:
            continue
        cells = " | ".join(_num(stat(data, name)) for name in STATS)
        lines.append(f"| {metric} | {len(data)} | {cells} |")
    notes = sorted({t.note for t in trials if t.note})
    lines += [f"- note: {note}" for note in notes]
    return lines


def _num(value: float | None) -> str:
    if value is None:
        return "n/a"
    if math.isinf(value):
        return "timeout"
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.1f}" if abs(value) >= 1 or value == 0 else f"{value:.4f}"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:.3f}%"
