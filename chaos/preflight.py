"""Before anything starts: every stage's policy loads and can host the stage's faults.

Every problem of every stage is reported at once. `schema_only` checks the policies'
shape and cross-field rules but not what lives on this machine (the model's files), so a
GPU scenario can be checked anywhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from chaos.errors import ScenarioError
from chaos.faults import requirement
from chaos.models import missing_dirs
from chaos.scenario import Plan
from chaos.stagepolicy import load_stage_policy, policy_data
from supervisor.errors import PolicyError
from supervisor.policy import Policy
from supervisor.policy_file import parse_policy


def preflight(
    plan: Plan, override: Path | None, *, attached: bool = False, schema_only: bool = False
) -> list[Policy]:
    """The policy of every stage; ScenarioError listing every problem found."""
    policies: list[Policy] = []
    problems: list[str] = []
    for stage in plan.scenario.stages:
        path = override or plan.policy_path(stage)
        overrides = stage.policy_overrides
        if attached and overrides:
            problems.append(
                f"stage {stage.name}: policy_overrides cannot change a supervisor already "
                "running; drop --attach, or the stage's policy_overrides"
            )
            continue
        try:
            policy = (
                schema_policy(path, overrides)
                if schema_only
                else load_stage_policy(path, overrides)
            )
        except PolicyError as exc:
            problems += [f"stage {stage.name}: policy {path}: {e}" for e in exc.errors]
            continue
        for kind in sorted({f.kind for f in stage.faults}):
            why = requirement(kind, policy, own_broker=not attached, attached=attached)
            if why is not None:
                problems.append(f"stage {stage.name}: {why}")
        if not schema_only:
            models = [model for fault in stage.faults for model in fault.models]
            problems += [
                f"stage {stage.name}: {why}" for why in missing_dirs(models, plan.source.parent)
            ]
        policies.append(policy)
    if problems:
        raise ScenarioError("\n  ".join(["", *problems]).lstrip(), problems)
    return policies


def schema_policy(path: Path, overrides: dict[str, Any] | None = None) -> Policy:
    """A policy (with a stage's overrides) checked for shape and cross-field rules only, as
    `supervisor validate --schema-only` checks it: nothing of this machine is looked for
    (model.path is taken as given, vLLM need not be installed)."""
    data = policy_data(path, overrides or {})
    if not isinstance(data, dict):
        raise PolicyError(["$: expected a mapping at the top"], str(path))
    return parse_policy(yaml.safe_dump(data), path, schema_only=True)
