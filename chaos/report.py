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
from chaos.metrics import (
    COUNTS,
    EVIDENCE,
    MS_METRICS,
    STREAMS,
    UPDATES,
    CheckResult,
    RunFigures,
    StageSpan,
    TrialRow,
    blamed,
    stat,
    values,
)
from chaos.models import UPDATE_FAULTS
from chaos.recorder import EventRow
from chaos.throughput import Rate

STATS = ("p50", "p95", "p99", "max")


class RunMeta(msgspec.Struct, frozen=True):
    scenario: str
    command: str
    started: str  # ISO 8601, UTC
    finished: str
    machine: str
    complete: bool  # False when the run was interrupted or a stage failed to start
    note: str = ""
    load: str = ""  # the load, in words


class Results(msgspec.Struct, frozen=True):
    meta: RunMeta
    run: RunFigures
    checks: list[CheckResult]
    trials: list[TrialRow]
    requests: list[RequestRow]
    events: list[EventRow]
    stages: list[StageSpan] = []
    baseline: Rate | None = None
    rates: list[Rate] = []  # per fault kind


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
        *([f"- load: {meta.load}"] if meta.load else []),
        f"- complete: {'yes' if meta.complete else 'no (partial)'}"
        + (f" — {meta.note}" if meta.note else ""),
        "",
        "## Whole run",
        "",
        "| faults injected | skipped | trials failed | requests | failed | shed | retried "
        "| availability | excl. kill-supervisor | baseline p50 ms | lingering processes |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| {run.faults} | {run.skipped_faults} | {run.failed_trials} | {run.requests} "
        f"| {run.failed_requests} | {run.shed_requests} | {run.retried_requests} "
        f"| {_pct(run.availability)} | {_pct(run.availability_excl_kill_supervisor)} "
        f"| {num(run.baseline_p50_ms)} | {run.lingering_processes} |",
        "",
        "Availability is successful / (successful + failed); shed requests (503 with "
        "Retry-After: the engine refusing overload) count in neither.",
        "",
        *_streams(run),
        *_versions(run),
        "## Checks",
        "",
        "| check | value | result |",
        "| --- | ---: | --- |",
        *[
            f"| `{c.check}` | {num(c.value)} | {'pass' if c.passed else '**FAIL**'} |"
            for c in results.checks
        ],
        "",
        *_throughput(results),
        "## Per fault",
        "",
        "Times in ms from the moment the fault was injected; `timeout` means the trial ended "
        "without it. Counts are requests per trial. Skipped trials (no victim by the policy's "
        "own rule) measure nothing; failed ones count as timeouts.",
    ]
    for fault in sorted({t.fault for t in results.trials}):
        lines += ["", *_fault_table(fault, [t for t in results.trials if t.fault == fault])]
    lines += ["", *_failed_requests(results)]
    lines += ["## Plots", "", "![timeline](timeline.png)", "", "![recovery](recovery.png)", ""]
    return "\n".join(lines)


def _streams(run: RunFigures) -> list[str]:
    if not run.streams:
        return []
    return [
        f"Streams: {run.streams} streamed, {run.broken_streams} broken (an error event, a cut "
        f"or a short answer; counted as failed), {run.migrated_streams} migrated to the next "
        f"primary, {run.twin_mismatches} unlike their fault-free twins "
        f"({run.migrated_twin_mismatches} of them migrated).",
        "",
    ]


def _versions(run: RunFigures) -> list[str]:
    if not run.served_versions:
        return []
    return [
        f"Model versions: {run.versions} answered; served (as /cluster said): "
        f"{', '.join(run.served_versions)}. {run.unlabelled_answers} answers without their "
        f"version, {run.unserved_versions} of a version never served, "
        f"{run.twin_versions_alike} twin prompts two versions answered alike.",
        "",
    ]


def _throughput(results: Results) -> list[str]:
    base = results.baseline
    if base is None:
        return []
    rows = [base, *results.rates]
    return [
        "## Throughput",
        "",
        "Successful requests and output tokens per second before the first fault (the "
        "baseline) and inside each fault kind's trials; the drop is of tokens/s. A request "
        "counts where it ended; its tokens count where they came (spread over its time).",
        "",
        "| when | seconds | requests/s | output tokens/s | drop |",
        "| --- | ---: | ---: | ---: | ---: |",
        *[
            f"| {r.label} | {num(r.seconds)} | {num(r.requests_per_s)} | {num(r.tokens_per_s)} "
            f"| {'' if r.drop_pct is None else f'{r.drop_pct:.1f}%'} |"
            for r in rows
        ],
        "",
    ]


def _failed_requests(results: Results) -> list[str]:
    failed = [r for r in results.requests if r.failed]
    lines = ["## Failed requests", ""]
    if not failed:
        return [*lines, "None.", ""]
    t0 = min(r.start for r in results.requests)
    lines += [
        "| trial | fault | started s | status | attempts | engine | error |",
        "| ---: | --- | ---: | ---: | ---: | --- | --- |",
    ]
    for row in failed:
        trial = blamed(row, results.trials)
        where = (str(trial.index), trial.fault) if trial else ("", "before the first fault")
        error = row.error.replace("|", "/")
        lines.append(
            f"| {where[0]} | {where[1]} | {row.start - t0:.2f} | {row.status} | {row.attempts} "
            f"| {row.engine} | {error} |"
        )
    return [*lines, ""]


def _fault_table(fault: str, trials: Sequence[TrialRow]) -> list[str]:
    skipped = sum(1 for t in trials if t.outcome == "skipped")
    failed = sum(1 for t in trials if t.outcome == "failed")
    extra = "".join(
        f", {n} {word}" for n, word in ((skipped, "skipped"), (failed, "not injected")) if n
    )
    lines = [
        f"### {fault} ({len(trials)} trials{extra})",
        "",
        "| metric | n | p50 | p95 | p99 | max |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    streamed = any(t.migrated_streams or t.broken_streams for t in trials)
    for metric in (*MS_METRICS, *COUNTS, *STREAMS, *EVIDENCE, *UPDATES):
        data = values(trials, metric)
        if not data or (metric in STREAMS and not streamed):
            continue
        if metric in UPDATES and fault not in UPDATE_FAULTS:
            continue
        cells = " | ".join(num(stat(data, name)) for name in STATS)
        lines.append(f"| {metric} | {len(data)} | {cells} |")
    if len(lines) == 4:  # nothing measured (every trial skipped): no empty table
        lines = lines[:2]
    notes = sorted({t.note for t in trials if t.note})
    lines += [f"- note: {note}" for note in notes]
    return lines


def num(value: float | None) -> str:
    """A figure as people read it: 7.87043571472168 -> 7.9, 1234.5 -> 1234, 0.99912 -> 0.9991."""
    if value is None or math.isnan(value):
        return "n/a"
    if math.isinf(value):
        return "timeout"
    if value == int(value):
        return str(int(value))
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.1f}" if abs(value) >= 1 else f"{value:.4g}"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:.3f}%"
