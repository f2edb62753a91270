"""Report figures a reader relies on: no false timeouts, rounded numbers, every failed
request listed with its trial, availability without kill-supervisor trials, shed load,
throughput against the baseline, and a timeline that marks stages instead of showing gaps."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from chaos.checks import parse_check
from chaos.load import RequestRow
from chaos.metrics import StageSpan, TrialRow, evaluate, run_figures, with_requests
from chaos.plots import _rates, bin_seconds, timeline
from chaos.report import Results, RunMeta, markdown, num
from chaos.scenario import FAULTS
from chaos.throughput import baseline, per_fault

META = RunMeta("t", "chaos run t.yaml", "2026-01-01T00:00:00Z", "2026-01-01T00:01:00Z", "m", True)


def _ok(start: float, tokens: int = 16) -> RequestRow:
    return RequestRow(start, start + 0.05, 200, 1, "e1", 1, tokens=tokens)


def _steady(t0: float, t1: float, step: float = 0.1) -> list[RequestRow]:
    return [_ok(t0 + i * step) for i in range(round((t1 - t0) / step))]


def test_a_passed_trial_without_a_baseline_reports_no_added_latency_timeout() -> None:
    rows = _steady(100.0, 102.0)
    trial = with_requests(
        TrialRow(0, "main", "kill-standby", "s", 1, 101.0, 101.5, 3.0, None), rows, None
    )
    assert trial.added_latency_ms is None and trial.failed_requests == 0
    run = run_figures(rows, [trial], None)
    text = markdown(Results(META, run, [], [trial], rows, []))
    assert "| timeout |" not in text and "| added_latency_ms |" not in text
    check = parse_check("kill-standby.added_latency_ms.max < 100", faults=FAULTS)
    assert evaluate(check, [trial], run).value is None  # no data: n/a, and the check fails


def test_numbers_are_rounded_for_people() -> None:
    assert num(7.87043571472168) == "7.9"
    assert num(1234.5678) == "1235"
    assert num(0.000123456) == "0.0001235"
    assert num(12.0) == "12" and num(math.inf) == "timeout" and num(None) == "n/a"
    rows = [RequestRow(100.0, 100.0078704357, 200, 1, "e", 1)] + _steady(100.1, 101.0)
    trial = with_requests(
        TrialRow(0, "main", "kill-primary", "e", 1, 100.5, 100.9, 3.0, 7.87043571472168),
        rows,
        7.87043571472168,
    )
    text = markdown(
        Results(META, run_figures(rows, [trial], 7.87043571472168), [], [trial], rows, [])
    )
    assert not re.search(r"\d\.\d{5,}", text), text


def test_failed_requests_are_listed_with_their_trial_and_kill_supervisor_is_set_apart() -> None:
    rows = _steady(100.0, 110.0)
    rows.append(RequestRow(102.2, 102.5, 502, 3, "e1", 1, "bad gateway"))
    rows.append(RequestRow(106.1, 106.9, 0, 3, "", None, "ClientConnectorError: refused"))
    rows.append(RequestRow(106.2, 106.3, 503, 3, "e1", 1, shed=True))
    trials = [
        TrialRow(0, "main", "kill-primary", "e1", 1, 102.0, 103.0, 2.0, 9.0),
        TrialRow(1, "main", "kill-supervisor", "main", 2, 106.0, 108.0, None, None),
    ]
    trials = [with_requests(t, rows, 10.0, trials) for t in trials]
    run = run_figures(rows, trials, 10.0)
    assert run.failed_requests == 2 and run.shed_requests == 1
    assert trials[1].shed_requests == 1 and trials[1].failed_requests == 1
    total = len(rows) - 1  # the shed one counts in neither
    assert run.availability == pytest.approx((total - 2) / total, abs=1e-6)
    outside = [r for r in rows if not 106.0 <= r.start < 108.0]
    assert run.availability_excl_kill_supervisor == pytest.approx(
        (len(outside) - 1) / len(outside), abs=1e-6
    )
    text = markdown(Results(META, run, [], trials, rows, []))
    assert "| 0 | kill-primary | 2.20 | 502 | 3 | e1 | bad gateway |" in text
    assert "| 1 | kill-supervisor | 6.10 | 0 | 3 |  | ClientConnectorError: refused |" in text


def test_a_request_that_fails_after_the_next_fault_counts_against_that_fault() -> None:
    """Started late in a stop-standby trial, still in flight when the next trial killed the
    supervisor (and its router): the failure is the kill's, not the standby's."""
    rows = _steady(100.0, 110.0)
    late = RequestRow(105.9, 106.4, 0, 4, "e2", 1, "ClientConnectorError: refused")
    between = RequestRow(107.5, 108.5, 502, 4, "e1", 1, "bad gateway")
    rows += [late, between]
    trials = [
        TrialRow(0, "main", "stop-standby", "e2", 1, 105.0, 106.0, 2.0, 9.0),
        TrialRow(1, "main", "kill-supervisor", "main", 2, 106.1, 107.0, None, None),
    ]
    trials = [with_requests(t, rows, 10.0, trials) for t in trials]
    assert [t.failed_requests for t in trials] == [0, 2]
    run = run_figures(rows, trials, 10.0)
    assert run.failed_requests == 2 and run.availability_excl_kill_supervisor == 1.0
    text = markdown(Results(META, run, [], trials, rows, []))
    assert "| 1 | kill-supervisor | 5.90 | 0 | 4 | e2 |" in text
    assert "| 1 | kill-supervisor | 7.50 | 502 | 4 | e1 | bad gateway |" in text


def test_throughput_before_the_first_fault_and_its_drop_per_fault_kind() -> None:
    rows = _steady(100.0, 105.0) + [_ok(105.3), _ok(105.6)] + _steady(106.0, 110.0)  # a dip
    stages = [StageSpan("main", 100.0, 110.0)]
    trials = [TrialRow(0, "main", "kill-primary", "e1", 1, 105.0, 106.0, 2.0, 9.0)]
    base = baseline(rows, stages, before=104.0)
    assert base is not None
    assert (base.requests_per_s, base.tokens_per_s) == (10.0, 160.0)
    (during,) = per_fault(rows, trials, base)
    assert during.label == "kill-primary" and during.tokens_per_s == 16.0 * 2
    assert during.drop_pct == 80.0
    text = markdown(
        Results(META, run_figures(rows, trials, 10.0), [], trials, rows, [], stages, base, [during])
    )
    assert "| before the first fault | 4 | 10 | 160 |" in text and "| 80.0% |" in text


def test_bins_follow_the_run_length_and_stage_gaps_are_not_zero(tmp_path: Path) -> None:
    assert bin_seconds(60) == 0.5 and bin_seconds(600) == 2.0 and bin_seconds(3600) == 15.0
    rows = _steady(100.0, 110.0) + _steady(120.0, 130.0)
    stages = [StageSpan("main", 100.0, 110.2), StageSpan("tp2", 120.0, 130.2)]
    xs, ok, failed, tokens = _rates(rows, stages, 100.0, 30.2, 1.0)
    gap = [v for x, v in zip(xs, ok, strict=True) if 12 <= x <= 18]
    assert gap and all(math.isnan(v) for v in gap)  # blank, not an outage
    assert all(v > 0 for x, v in zip(xs, ok, strict=True) if 1 <= x <= 9)
    trials = [
        TrialRow(i, "main", kind, "e", 1, 102.0 + i, 102.5 + i, 1.0, None)
        for i, kind in enumerate(FAULTS)
    ]
    timeline(tmp_path / "t.png", rows, trials, stages)
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


def test_detection_checks_leave_out_faults_that_are_not_detected() -> None:
    """A killed supervisor is not detected by anyone: its replacement's first event is its
    start-up, which must not decide `detection_ms.p99`."""
    trials = [
        TrialRow(0, "main", "kill-primary", "e1", 1, 100.0, 101.0, 2.0, 1.0),
        TrialRow(1, "main", "kill-supervisor", "main", 2, 102.0, 110.0, 944.0, None),
    ]
    run = run_figures([], trials, None)
    result = evaluate(parse_check("detection_ms.p99 < 1000", faults=FAULTS), trials, run)
    assert result.value == 2.0 and result.passed


def test_long_answers_count_their_tokens_where_they_came_not_where_they_ended() -> None:
    """Four clients back to back, each answer 256 tokens over 2.5 s, offset by 0.625 s:
    1024 tokens every 2.5 s, 409.6 tokens/s, in any window, whatever its phase (counted
    where each answer ended, a 3 s window would hold 4 or 8 answers: 341 or 683)."""
    rows = [
        RequestRow(s, s + 2.5, 200, 1, "e1", 1, tokens=256)
        for c in range(4)
        for s in [100.0 + c * 0.625 + k * 2.5 for k in range(8)]
    ]
    stages = [StageSpan("main", 100.0, 120.0)]
    for start in (103.0, 103.4, 104.1):
        trials = [TrialRow(0, "main", "kill-primary", "e1", 1, start, start + 3.0, 2.0, 9.0)]
        (during,) = per_fault(rows, trials, None)
        assert during.tokens_per_s == 409.6
    base = baseline(rows, stages, before=103.0)
    assert base is not None and base.tokens_per_s < 409.6  # clients still starting up


def test_streams_unlike_their_fault_free_twins_are_counted_and_the_migrated_set_apart() -> None:
    """The twin of a prompt is the most common answer of its streams that no fault cut;
    a stream with other tokens is a mismatch, and a migrated one is counted apart too."""

    def stream(prompt: int, digest: str, migrated: int = 0) -> RequestRow:
        return RequestRow(
            0.0,
            1.0,
            200,
            1,
            "e1",
            1,
            streamed=True,
            migrated=migrated,
            prompt=prompt,
            digest=digest,
        )

    rows = [
        stream(0, "a"),
        stream(0, "a"),
        stream(0, "b"),  # never cut, yet unlike its twins (the batch it shared)
        stream(0, "a", migrated=1),
        stream(0, "c", migrated=1),
        stream(1, "z", migrated=1),  # no fault-free twin to compare with
        stream(1, ""),  # incomplete: no digest
    ]
    run = run_figures(rows, [], None)
    assert (run.streams, run.migrated_streams) == (7, 3)
    assert (run.twin_mismatches, run.migrated_twin_mismatches) == (2, 1)
    text = " ".join(markdown(Results(META, run, [], [], rows, [])).split())
    assert "2 unlike their fault-free twins (1 of them migrated)" in text


def test_continuations_are_counted_by_how_they_began_once_per_event() -> None:
    from chaos.recorder import EventRow

    def moved(ts: float, source: str, how: str, prefill: int) -> EventRow:
        detail = {"continued": how, "prefill": prefill, "kept": 90, "stall_ms": 30.0}
        return EventRow(ts, ts, source, "router", "main", "migrated", 2, detail)

    events = [
        *(moved(100.6, src, "adopted", 1) for src in ("zmq", "mqtt")),  # one event, twice
        moved(100.61, "zmq", "adopted", 1),
        moved(100.62, "zmq", "replayed", 140),
        moved(100.63, "zmq", "kept", 9),
        moved(102.0, "zmq", "replayed", 50),  # after the trial
        EventRow(100.7, 100.7, "zmq", "engine", "e2", "promoted", 2),
    ]
    rows = _steady(100.0, 101.0)
    trial = TrialRow(0, "main", "kill-primary", "e1", 1, 100.5, 101.0, 3.0, None)
    got = with_requests(trial, rows, None, [trial], events)
    assert (got.adopted_streams, got.kept_streams, got.replayed_streams) == (2, 1, 1)
    assert got.continuation_prefill_tokens == 1 + 1 + 140 + 9
