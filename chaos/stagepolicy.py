"""A stage's policy: the policy file, with the stage's `policy_overrides` merged onto it.

Overrides let a scenario run a policy written for other hardware with only what cannot
exist here replaced (the model, the devices, the cache backend), everything else taken
from the file itself, so a change to that file is exercised by the scenario.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from supervisor.errors import PolicyError
from supervisor.policy import Policy
from supervisor.policy_file import load_policy, parse_policy


def merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`base` with `overrides` merged on: mappings key by key, any other value replaces
    (a list as a whole; null sets the key to null)."""
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def policy_data(path: Path, overrides: dict[str, Any]) -> Any:
    """The policy file's YAML with `overrides` merged on; PolicyError when it cannot be read."""
    try:
        data: Any = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise PolicyError([f"cannot read {path}: {exc.strerror}"], str(path)) from exc
    except yaml.YAMLError as exc:
        raise PolicyError([f"$: not valid YAML: {exc}"], str(path)) from exc
    data = {} if data is None else data
    if overrides and isinstance(data, dict):
        data = merge(data, overrides)
    return data


def load_stage_policy(path: Path, overrides: dict[str, Any]) -> Policy:
    """The stage's policy, validated and resolved as `supervisor run` would (relative
    paths against the policy file's directory)."""
    if not overrides:
        return load_policy(path)
    return parse_policy(yaml.safe_dump(policy_data(path, overrides)), path)
