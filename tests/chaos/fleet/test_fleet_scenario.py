"""Fleet scenarios are validated like any other: fleet faults need a `fleet:` section, a
fleet runs only fleet faults, and checks name only what the run measures. The overlap of
two cluster epochs is computed from the response log as the fault harness does."""

from __future__ import annotations

from pathlib import Path

import pytest

from chaos.errors import ScenarioError
from chaos.fleet.analysis import overlap_ms
from chaos.fleet.faults import RUNNERS
from chaos.fleet.kinds import FLEET_FAULTS
from chaos.fleet.load import Row
from chaos.scenario import load_scenario

SCENARIOS = Path(__file__).resolve().parents[3] / "chaos" / "scenarios"

FLEET = """
name: f
trials: 1
fleet: {nodes: 3, ttl_s: 1}
stages:
  - name: main
    policy: p.yaml
    faults:
      - {kind: kill-node, trials: 2}
      - {kind: partition-node, hold_s: 3}
checks:
  - "kill-node.failover_ms.p99 < 2000"
  - "overlap_ms.max == 0"
"""


def _problems(tmp_path: Path, text: str) -> list[str]:
    path = tmp_path / "s.yaml"
    path.write_text(text)
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    return info.value.problems


def test_the_fleet_scenario_plans_every_fleet_fault() -> None:
    plan = load_scenario(SCENARIOS / "fleet.yaml")
    assert plan.scenario.fleet is not None and plan.scenario.fleet.ttl_s == 1
    assert {f.kind for f in plan.order[0]} == set(FLEET_FAULTS) == set(RUNNERS)


def test_a_good_fleet_scenario_loads(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(FLEET)
    plan = load_scenario(path)
    assert [f.kind for f in plan.order[0]] == ["kill-node", "kill-node", "partition-node"]


def test_fleet_faults_need_a_fleet_section(tmp_path: Path) -> None:
    text = FLEET.replace("fleet: {nodes: 3, ttl_s: 1}\n", "")
    problems = _problems(tmp_path, text)
    assert any("kill-node is a fleet fault; add a `fleet:` section" in p for p in problems)
    assert any("'failover_ms' is measured by fleet runs only" in p for p in problems)


def test_a_fleet_runs_only_fleet_faults_and_fleet_metrics(tmp_path: Path) -> None:
    text = FLEET.replace("{kind: kill-node, trials: 2}", "{kind: kill-primary}")
    text = text.replace('"overlap_ms.max == 0"', '"kill-node.promotion_ms.p99 < 9"')
    problems = _problems(tmp_path, text)
    assert any("kill-primary is a single-node fault" in p for p in problems), problems
    assert any("a fleet run does not measure 'promotion_ms'" in p for p in problems), problems


def test_fleet_section_ranges(tmp_path: Path) -> None:
    text = FLEET.replace("{nodes: 3, ttl_s: 1}", "{nodes: 1, ttl_s: 0, client_interval_ms: 0}")
    problems = _problems(tmp_path, text)
    assert any(p.startswith("$.fleet.nodes: 1 is out of range") for p in problems)
    assert any(p.startswith("$.fleet.ttl_s: 0 is out of range") for p in problems)
    assert any(p.startswith("$.fleet.client_interval_ms: 0") for p in problems)
    unknown = _problems(tmp_path, FLEET.replace("ttl_s: 1}", "tll_s: 1}"))
    assert any("tll_s" in p for p in unknown), unknown


def _row(sent: float, answered: float, epoch: int, node: str) -> Row:
    return Row(0, "hf-c1", "n2", sent, answered, 200, node, epoch, 1)


def test_a_request_held_across_a_leader_change_is_no_overlap() -> None:
    rows = [
        _row(0.0, 0.01, 5, "n1"),
        _row(0.02, 2.0, 9, "n2"),  # sent under n1, held by the router, answered by n2
        _row(1.0, 1.01, 5, "n1"),  # n1's last answer: sent before n2 answered anything
        _row(2.1, 2.11, 9, "n2"),
    ]
    assert overlap_ms(rows) == 0.0


def test_an_old_epoch_answering_after_a_new_one_did_is_overlap() -> None:
    rows = [_row(1.0, 1.01, 9, "n2"), _row(1.25, 1.26, 5, "n1"), _row(0.5, 0.6, 5, "n1")]
    assert overlap_ms(rows) == 240.0  # n1 answered a request sent 240 ms after n2 answered
    failed = Row(0, "hf-c1", "n1", 1.5, 1.6, 0, "", 0, 0, "refused")
    assert overlap_ms([*rows, failed]) == 240.0  # failures answered nothing
