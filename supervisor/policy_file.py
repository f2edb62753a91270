"""A policy file read into a `Policy`: the YAML, the schema (supervisor/policy.py) and its
rules between fields, then the engine kind's section and rules (supervisor/kinds/).

`load_policy(path)` returns a frozen `Policy` or raises `PolicyError` listing every problem
with its path in the file (`$.engines.standby: expected int, got str`). Unknown keys are
errors. `load_policy(None)` reads the embedded demo policy (`policies/demo.yaml`).
`schema_only=True` skips what depends on this machine (whether model.path holds a
checkpoint), for policies written for another one.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import msgspec
import yaml

from supervisor import kinds, schema
from supervisor.errors import PolicyError
from supervisor.policy import Policy, semantic_errors


def demo_path() -> Path:
    """The embedded default policy: the repo's policies/ dir, or where an install put it."""
    candidates = [
        Path(__file__).resolve().parents[1] / "policies" / "demo.yaml",
        Path(sys.prefix) / "share" / "holdfast" / "policies" / "demo.yaml",
    ]
    return next((c for c in candidates if c.is_file()), candidates[0])


def load_policy(path: str | os.PathLike[str] | None = None, *, schema_only: bool = False) -> Policy:
    """Read, validate and resolve a policy file; None reads the demo policy."""
    src = Path(path) if path is not None else demo_path()
    try:
        text = src.read_text()
    except OSError as e:
        raise PolicyError(
            [f"cannot read {src}: {e.strerror}; pass an existing policy file"], str(src)
        ) from e
    return parse_policy(text, src, schema_only=schema_only)


def parse_policy(text: str, src: Path, *, schema_only: bool = False) -> Policy:
    try:
        data: Any = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise PolicyError([f"$: not valid YAML: {e}"], str(src)) from e
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise PolicyError(
            [f"$: expected a mapping at the top, got {type(data).__name__}"], str(src)
        )
    data, section, errors = _kind_sections(data)
    errors = schema.check(data, Policy) + errors
    usable = schema.salvage(data, Policy) if errors else data
    if usable is None:  # a required key missing or wrong: nothing to check the rules on
        raise PolicyError(errors, str(src))
    policy = msgspec.convert({**usable, "source": str(src)}, Policy)
    policy = msgspec.structs.replace(
        policy, engines=msgspec.structs.replace(policy.engines, section=section)
    )
    policy = _resolve(policy, src.parent)
    # the rules between fields run on what converted, so one run reports every error
    errors += [
        e
        for e in rule_errors(policy, schema_only=schema_only)
        if not any(_same_place(e, bad) for bad in errors)
    ]
    if errors:
        raise PolicyError(errors, str(src))
    if policy.cluster is not None and not policy.cluster.advertise:
        cluster = msgspec.structs.replace(policy.cluster, advertise=policy.router.listen)
        policy = msgspec.structs.replace(policy, cluster=cluster)
    return policy


def _kind_sections(data: dict[str, Any]) -> tuple[dict[str, Any], Any, list[str]]:
    """`data` without the engine kinds' sections (`engines.<kind>`), the named kind's
    section, and what is wrong with the kind's name or any kind's section. An unknown
    kind is reported and left to its default, as a wrong value of any key is."""
    engines = data.get("engines")
    if not isinstance(engines, dict):
        return data, None, []
    name = engines.get("kind", "holdfast")
    unknown = kinds.known(name) if isinstance(name, str) else []
    rest, section, errors = kinds.take_sections(engines)
    if unknown:
        del rest["kind"]
    return {**data, "engines": rest}, section, unknown + errors


def policy_data(p: Policy) -> dict[str, Any]:
    """`p` as the plain data of a policy file that reads back as `p`: its kind's section
    under `engines.<kind>`, no `source`."""
    data: dict[str, Any] = msgspec.to_builtins(p)
    data.pop("source", None)
    section = data["engines"].pop("section", None)
    if section is not None:
        data["engines"][p.engines.kind] = section
    return data


def rule_errors(p: Policy, *, schema_only: bool = False) -> list[str]:
    """The rules between fields: the schema's (`policy.semantic_errors`), then those of
    the engine kind (`kinds.Kind.errors`); with `schema_only`, none that look at this
    machine."""
    return semantic_errors(p, schema_only=schema_only) + kinds.kind_of(p).errors(
        p, schema_only=schema_only
    )


def _same_place(error: str, other: str) -> bool:
    """Whether two `$.path: message` lines are about the same value (or one inside the
    other): a rule is not reported on a value whose type was wrong already."""
    a, b = error.partition(":")[0], other.partition(":")[0]
    return a == b or a.startswith((b + ".", b + "[")) or b.startswith((a + ".", a + "["))


def _resolve(policy: Policy, base: Path) -> Policy:
    """Paths made absolute (model.path against the policy file's dir), then the engine
    kind's start command filled in (`Kind.resolve`)."""
    model = policy.model
    if model.path is not None:
        model = msgspec.structs.replace(model, path=str((base / model.path).resolve()))
    run = str(Path(os.path.expandvars(os.path.expanduser(policy.cache.runtime_dir))).absolute())
    cache = msgspec.structs.replace(policy.cache, runtime_dir=run)
    resolved = msgspec.structs.replace(policy, model=model, cache=cache)
    return kinds.kind_of(resolved).resolve(resolved)
