"""The `update` and `refit` fault kinds before anything runs: their keys (`models`,
`expect`) validated with their paths, the checkpoints made ready on disk and picked so that
updates alternate, an update's end told apart from an earlier one's, and the checks
that read them."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from chaos.checks import parse_check
from chaos.errors import ScenarioError
from chaos.metrics import TrialRow, evaluate, run_figures, values
from chaos.models import ModelRef, prepare
from chaos.preflight import preflight
from chaos.scenario import FAULTS, load_scenario
from chaos.stagepolicy import load_stage_policy
from chaos.updates import mine
from holdfast_contract.control import UpdateStatus

SCENARIOS = Path(__file__).resolve().parents[2] / "chaos" / "scenarios"
POLICY = SCENARIOS / "policy-cpu.yaml"
TWO = "[{preset: tiny, seed: 1}, {preset: tiny, seed: 0}]"


def _scenario(tmp_path: Path, faults: str, checks: str = "[]") -> Path:
    path = tmp_path / "scenario.yaml"
    path.write_text(
        f"name: t\nstages:\n  - name: main\n    policy: {POLICY}\n    faults:\n{faults}\n"
        f"checks: {checks}\n"
    )
    return path


def _problems(path: Path) -> list[str]:
    with pytest.raises(ScenarioError) as caught:
        load_scenario(path)
    return caught.value.problems


def test_updates_and_refits_plan_with_their_models_and_expected_end(tmp_path: Path) -> None:
    bad = "{preset: tiny, config: {rope_scaling: {rope_type: bogus}}}"
    path = _scenario(
        tmp_path,
        f"      - {{kind: update, trials: 2, models: {TWO}}}\n"
        f"      - {{kind: refit, models: {TWO}}}\n"
        f"      - {{kind: update, expect: rolled-back, models: [{bad}]}}",
        '["update.rolled_back == 1", "refit.pool_copies.max <= 1", "unserved_versions == 0"]',
    )
    plan = load_scenario(path, trials=None)
    faults = plan.order[0]
    assert [(f.kind, f.expect) for f in faults] == [
        ("update", "finished"),
        ("update", "finished"),
        ("refit", "finished"),
        ("refit", "finished"),
        ("update", "rolled-back"),
        ("update", "rolled-back"),
    ]
    assert faults[0].models == [ModelRef(preset="tiny", seed=1), ModelRef(preset="tiny")]
    assert faults[-1].models[0].config == {"rope_scaling": {"rope_type": "bogus"}}
    rolled, pools, unserved = plan.checks
    assert (rolled.scope, rolled.metric, rolled.stat) == ("update", "rolled_back", "sum")
    assert (pools.scope, pools.stat) == ("refit", "max")
    assert (unserved.scope, unserved.stat) == (None, None)


def test_an_update_without_models_and_models_on_another_kind_are_refused(tmp_path: Path) -> None:
    problems = _problems(
        _scenario(
            tmp_path,
            "      - {kind: refit}\n"
            f"      - {{kind: kill-primary, models: {TWO}, expect: rolled-back}}\n"
            "      - {kind: update, models: [{preset: tiny, path: /m}, {seed: 2}]}\n"
            "      - {kind: update, expect: maybe, models: [{preset: tiny, sed: 1}]}",
        )
    )
    assert len(problems) == 7, problems
    assert any(
        p.startswith("$.stages[0].faults[0].models: a refit fault needs the checkpoints")
        for p in problems
    )
    for key in ("models", "expect"):
        assert any(
            p.startswith(f"$.stages[0].faults[1].{key}: only refit and update faults take")
            for p in problems
        ), key
    for i in (0, 1):
        assert any(
            p.startswith(f"$.stages[0].faults[2].models[{i}]: set exactly one of `path`")
            for p in problems
        ), i
    assert any(p.startswith("$.stages[0].faults[3].expect") for p in problems)
    assert any(p.startswith("$.stages[0].faults[3].models[0].sed: unknown key") for p in problems)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("update.unserved_versions == 0", "whole-run figure"),
        ("versions.max == 2", "takes no statistic"),
        ("update.pool_copy.max <= 1", "unknown metric 'pool_copy'"),
    ],
)
def test_checks_of_the_new_figures_keep_to_the_grammar(text: str, match: str) -> None:
    with pytest.raises(ScenarioError, match=match):
        parse_check(text, faults=FAULTS)


def test_a_model_dir_that_is_not_there_is_found_before_anything_starts(tmp_path: Path) -> None:
    path = _scenario(tmp_path, "      - {kind: update, models: [{path: no-such-dir}]}")
    plan = load_scenario(path)
    with pytest.raises(ScenarioError) as caught:
        preflight(plan, None)
    (problem,) = caught.value.problems
    assert "model path no-such-dir" in problem and str(tmp_path / "no-such-dir") in problem
    assert preflight(plan, None, schema_only=True)  # anywhere: model files not looked for


def test_checkpoints_are_made_once_and_each_trial_takes_one_not_serving(
    tmp_path: Path, tiny_model: Path
) -> None:
    other = tmp_path / "other"
    other.mkdir()
    for f in tiny_model.iterdir():
        if f.is_file():
            (other / f.name).write_bytes(f.read_bytes())
    policy = load_stage_policy(POLICY, {"model": {"path": str(tiny_model), "preset": None}})
    a, b = ModelRef(path=str(tiny_model)), ModelRef(path="other")
    bad = ModelRef(path=str(tiny_model), config={"rope_scaling": {"rope_type": "bogus"}})
    ckpts = asyncio.run(prepare([b, a, bad, b], tmp_path, policy, tmp_path / "made"))
    assert ckpts.serving == tiny_model.resolve()
    assert ckpts.next([b, a]) == other.resolve()
    ckpts.serving = other.resolve()  # the update to it finished
    assert ckpts.next([b, a]) == tiny_model.resolve()
    copy = ckpts.next([bad])
    assert copy.parent == tmp_path / "made" and copy != tiny_model.resolve()
    assert json.loads((copy / "config.json").read_text())["rope_scaling"] == {"rope_type": "bogus"}
    assert "rope_scaling" not in json.loads((tiny_model / "config.json").read_text())
    shards = sorted(p.name for p in tiny_model.glob("*.safetensors"))
    assert shards and sorted(p.name for p in copy.glob("*.safetensors")) == shards
    for name in shards:
        assert (copy / name).read_bytes() == (tiny_model / name).read_bytes()
        assert (copy / name).stat().st_ino != (tiny_model / name).stat().st_ino  # a copy


def test_an_update_end_is_this_updates_not_an_earlier_ones() -> None:
    target, sent = Path("/m/tiny-seed1"), 1000.0

    def st(**kw: object) -> UpdateStatus:
        fields: dict[str, object] = {
            "state": "finished",
            "version_from": "va",
            "version_to": "vb",
            "model": str(target),
            "started": 1000.5,
            "kind": "update",
        }
        return UpdateStatus(**{**fields, **kw})  # type: ignore[arg-type]

    assert mine(st(), "update", target, sent)
    assert mine(st(state="rolled-back"), "update", target, sent)
    assert not mine(st(state="keeping"), "update", target, sent)  # not over yet
    assert not mine(st(started=999.0), "update", target, sent)  # the one before
    assert not mine(st(kind="refit"), "update", target, sent)
    assert not mine(st(model="/m/tiny-seed0"), "update", target, sent)
    assert not mine(None, "update", target, sent)


def test_an_update_that_never_ended_fails_every_check_of_its_figures() -> None:
    """A failed trial (refused, or no end in time) has no figures: each counts as a
    timeout, so `update.unexpected_end == 0` and the pool checks fail on it."""
    ended = TrialRow(
        0,
        "main",
        "update",
        "update:update",
        None,
        10.0,
        20.0,
        None,
        None,
        update_ms=8000.0,
        rolled_back=0,
        unexpected_end=0,
        pool_copies=1.0,
        peak_pool_copies=2.0,
    )
    never = TrialRow(1, "main", "update", "", None, 30.0, 30.0, None, None, outcome="failed")
    run = run_figures([], [ended, never], None)
    for text in (
        "update.unexpected_end == 0",
        "update.pool_copies.max <= 1",
        "update.rolled_back == 0",
        "update.update_ms.max < 60000",
    ):
        check = parse_check(text, faults=FAULTS)
        assert evaluate(check, [ended], run).passed, text
        assert not evaluate(check, [ended, never], run).passed, text
    assert values([ended], "detection_ms") == []  # nothing detects an asked-for update
