"""Report and figures from synthetic rows (real runs are the integration test)."""

from __future__ import annotations

import math
from pathlib import Path

import msgspec
import pytest

from chaos.checks import parse_check
from chaos.load import RequestRow
from chaos.metrics import TrialRow, baseline_ms, evaluate, run_figures, stat, with_requests
from chaos.plots import recovery, timeline
from chaos.report import Results, RunMeta, markdown, write
from chaos.scenario import FAULTS


def _rows() -> list[RequestRow]:
    rows = [
        RequestRow(100.0 + i * 0.05, 100.0 + i * 0.05 + 0.01, 200, 1, "e1", 1) for i in range(40)
    ]
    rows.append(RequestRow(102.05, 102.30, 0, 3, "", None, "ClientOSError"))  # failed
    rows.append(RequestRow(102.06, 102.20, 200, 2, "e2", 2))  # retried, first ok
    rows += [RequestRow(102.3 + i * 0.05, 102.31 + i * 0.05, 200, 1, "e2", 2) for i in range(20)]
    return rows


def _trials(rows: list[RequestRow]) -> list[TrialRow]:
    base = baseline_ms(rows, before=102.0)
    kill = TrialRow(0, "main", "kill-primary", "e1", 11, 102.0, 103.0, 3.0, 12.0)
    batch = TrialRow(1, "main", "kill-batch", "b1", 12, 103.0, 104.0, 2.0, None)
    lost = TrialRow(2, "main", "kill-primary", "e2", 13, 104.0, 105.0, None, None)
    return [with_requests(t, rows, base) for t in (kill, batch, lost)]


def test_trial_figures_come_from_the_requests_inside_it() -> None:
    rows = _rows()
    kill = _trials(rows)[0]
    assert kill.failed_requests == 1 and kill.retried_requests == 2
    assert kill.recovery_ms == pytest.approx(200.0)
    assert kill.added_latency_ms == pytest.approx(250.0 - 10.0, abs=0.5)


def test_missing_promotion_counts_as_timeout_and_fails_the_check() -> None:
    rows = _rows()
    trials = _trials(rows)
    run = run_figures(rows, trials, baseline_ms(rows, 102.0))
    p99 = parse_check("kill-primary.promotion_ms.p99 < 100", faults=FAULTS)
    result = evaluate(p99, trials, run)
    assert not result.passed and result.value is not None and math.isinf(result.value)
    p50 = parse_check("kill-primary.promotion_ms.p50 < 100", faults=FAULTS)
    assert evaluate(p50, trials, run).passed
    assert not evaluate(parse_check("failed_requests == 0", faults=FAULTS), trials, run).passed
    assert run.availability == pytest.approx(61 / 62)


def test_percentiles_are_nearest_rank() -> None:
    data = [float(i) for i in range(1, 101)]
    assert [stat(data, s) for s in ("p50", "p95", "p99", "max", "count")] == [50, 95, 99, 100, 100]
    assert stat([], "p99") is None


def test_report_files(tmp_path: Path) -> None:
    rows = _rows()
    trials = _trials(rows)
    run = run_figures(rows, trials, baseline_ms(rows, 102.0))
    checks = [evaluate(parse_check("failed_requests == 0", faults=FAULTS), trials, run)]
    meta = RunMeta(
        "synthetic", "chaos run x.yaml", "2026-01-01T00:00:00Z", "2026-01-01T00:01:00Z", "m", True
    )
    results = Results(meta, run, checks, trials, rows, [])
    write(tmp_path, results)
    timeline(tmp_path / "timeline.png", rows, trials)
    recovery(tmp_path / "recovery.png", trials)
    text = (tmp_path / "report.md").read_text()
    assert "### kill-primary (2 trials)" in text and "### kill-batch (1 trials)" in text
    assert "| promotion_ms | 2 | 12 | timeout | timeout | timeout |" in text
    assert "**FAIL**" in text
    back = msgspec.json.decode((tmp_path / "results.json").read_bytes(), type=Results)
    assert back.trials == trials and len(back.requests) == len(rows)
    for png in ("timeline.png", "recovery.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
    assert markdown(results).count("| metric |") == 2
