"""Scenario validation and the check grammar: bad input is refused before anything starts."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import yaml

from chaos.checks import parse_check
from chaos.errors import CheckSyntaxError, ScenarioError
from chaos.scenario import FAULTS, Scenario, load_scenario

SCENARIOS = Path(__file__).resolve().parents[2] / "chaos" / "scenarios"

GOOD = """
name: t
seed: 3
order: random
trials: 2
stages:
  - name: main
    policy: p.yaml
    faults:
      - kind: kill-primary
      - kind: kill-batch
        trials: 3
checks:
  - "kill-primary.promotion_ms.p99 < 100"
  - "failed_requests == 0"
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "scenario.yaml"
    path.write_text(text)
    return path


def test_plan_counts_trials_and_resolves_policy_next_to_scenario(tmp_path: Path) -> None:
    plan = load_scenario(_write(tmp_path, GOOD))
    kinds = [f.kind for f in plan.order[0]]
    assert sorted(kinds) == ["kill-batch"] * 3 + ["kill-primary"] * 2
    assert plan.policy_path(plan.scenario.stages[0]) == (tmp_path / "p.yaml").resolve()
    assert plan.total_faults == 5


def test_random_order_is_seeded(tmp_path: Path) -> None:
    path = _write(tmp_path, GOOD)
    draws = {tuple(f.kind for f in load_scenario(path, trials=6).order[0]) for _ in range(3)}
    assert len(draws) == 1
    other = tuple(f.kind for f in load_scenario(path, trials=6, seed=99).order[0])
    assert other != next(iter(draws))


def test_unknown_key_names_its_path(tmp_path: Path) -> None:
    text = GOOD.replace("trials: 2\n", "trials: 2\nload:\n  concurency: 3\n")
    with pytest.raises(ScenarioError, match=r"\$\.load\.concurency: unknown key"):
        load_scenario(_write(tmp_path, text))


def test_unknown_fault_kind_lists_the_valid_ones(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match=r"faults\[1\]\.kind.*'kill-bach'.*kill-primary"):
        load_scenario(_write(tmp_path, GOOD.replace("kind: kill-batch", "kind: kill-bach")))


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("promotion_ms.p99 < 1e2; rm -rf /", "does not read as"),
        ("__import__('os') < 1", "does not read as"),
        ("promotoin_ms.p99 < 100", "unknown metric 'promotoin_ms'.*promotion_ms"),
        ("promotion_ms.p42 < 100", "unknown statistic 'p42'"),
        ("availability.p99 > 0.9", "whole-run figure"),
        ("kill-primary.availability > 0.9", "whole-run figure"),
        ("promotion_ms.p99 =< 100", "does not read as"),
    ],
)
def test_bad_checks_are_refused_with_the_grammar(text: str, match: str) -> None:
    with pytest.raises(CheckSyntaxError, match=match):
        parse_check(text, faults=FAULTS)


def test_bad_check_in_scenario_fails_at_load(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match=r"\$\.checks: check 'fails == 0': unknown metric"):
        load_scenario(_write(tmp_path, GOOD.replace("failed_requests == 0", "fails == 0")))


def test_check_parts_and_defaults() -> None:
    check = parse_check("kill-primary.promotion_ms.p99 < 100", faults=FAULTS)
    assert (check.scope, check.metric, check.stat, check.op) == (
        "kill-primary",
        "promotion_ms",
        "p99",
        "<",
    )
    assert check.holds(99.0) and not check.holds(100.0) and not check.holds(None)
    run_level = parse_check("failed_requests == 0", faults=FAULTS)
    assert run_level.stat is None
    per_fault = parse_check("kill-batch.failed_requests <= 2", faults=FAULTS)
    assert per_fault.stat == "sum"


@pytest.mark.parametrize(
    "name", ["smoke.yaml", "soak.yaml", "gpu.yaml", "gpu-tp2.yaml", "primary.yaml", "update.yaml"]
)
def test_shipped_scenarios_validate(name: str) -> None:
    plan = load_scenario(SCENARIOS / name)
    assert plan.total_faults > 0 and plan.checks
    for stage in plan.scenario.stages:
        assert plan.policy_path(stage).is_file(), stage.policy


def test_max_faults_runs_a_prefix_of_the_same_order(tmp_path: Path) -> None:
    path = _write(tmp_path, GOOD)
    full = [f.kind for f in load_scenario(path, trials=10).order[0]]
    short = [f.kind for f in load_scenario(path, trials=10, max_faults=7).order[0]]
    assert short == full[:7]


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    text = (
        GOOD.replace("kind: kill-batch", "kind: kill-bach")
        .replace("failed_requests == 0", "fails == 0")
        .replace("seed: 3", "seed: 3\nload:\n  concurency: 3\n  rate: 0")
    )
    with pytest.raises(ScenarioError) as caught:
        load_scenario(_write(tmp_path, text))
    problems = caught.value.problems
    assert len(problems) == 4, problems
    assert any(p.startswith("$.load.concurency: unknown key") for p in problems)
    assert any(p.startswith("$.load.rate: 0 is out of range") for p in problems)
    assert any("'kill-bach'" in p for p in problems)
    assert any("unknown metric 'fails'" in p for p in problems)


def test_every_key_an_error_lists_as_allowed_is_accepted(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError) as caught:
        load_scenario(_write(tmp_path, GOOD + "sead: 1\n"))
    (problem,) = caught.value.problems
    allowed = problem.split("allowed here: ")[1].split(", ")
    assert "stages" in allowed and "checks" in allowed
    values = {"stages": None, "checks": None, "name": None}  # already in GOOD
    for key in allowed:
        if key in values:
            continue
        default = msgspec.to_builtins(getattr(Scenario(name="t", stages=[]), key))
        plan = load_scenario(_write(tmp_path, GOOD + yaml.safe_dump({key: default})))
        assert plan.total_faults == 5, key
