"""Engine kinds (`engines.kind`), registered by name: `registry()`.

A kind (`base.Kind`) owns its policy section (`engines.<name>`), its start command, its
probes, its stream shape and its warming; the supervisor reaches kinds only through this
registry and that interface. The policy schema (supervisor/policy.py) imports no kind: it
keeps the kind's name and its section, which `policy_file` hands to the kind here
(`take_sections`, `known`) after the YAML is read.

Built in: `holdfast` (supervisor/kinds/reference.py) and `vllm` (supervisor/kinds/vllm.py).
More are registered from outside the package, each as `module:attribute` naming a `Kind`
instance: in the entry point group `holdfast.engine_kinds` of an installed distribution,
or in `$HOLDFAST_KINDS` (comma-separated), read when the registry is first used.
"""

from __future__ import annotations

import importlib
import os
from functools import cache
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

import msgspec

from supervisor import schema
from supervisor.errors import PolicyError
from supervisor.kinds import reference, vllm
from supervisor.kinds.base import Forks, Kind, Probe

if TYPE_CHECKING:
    from supervisor.policy import Policy

__all__ = [
    "ENV",
    "GROUP",
    "Forks",
    "Kind",
    "Probe",
    "kind_of",
    "known",
    "registry",
    "take_sections",
]

ENV = "HOLDFAST_KINDS"  # module:attribute[,module:attribute...]
GROUP = "holdfast.engine_kinds"  # entry points, each naming a Kind instance
BUILTIN: tuple[Kind, ...] = (reference.KIND, vllm.KIND)


def _load(spec: str, where: str) -> Kind:
    module, _, attr = spec.strip().partition(":")
    try:
        found = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise PolicyError([f"{spec!r}: cannot load the engine kind: {e}"], where) from e
    if not isinstance(found, Kind):
        raise PolicyError([f"{spec!r}: {type(found).__name__} is not an engine Kind"], where)
    return found


@cache
def registry() -> dict[str, Kind]:
    """Every kind by name: the built-in ones, the entry points', then `$HOLDFAST_KINDS`'."""
    kinds = {k.name: k for k in BUILTIN}
    for ep in entry_points(group=GROUP):
        kinds.setdefault(ep.name, _load(ep.value, f"entry point {GROUP}"))
    for spec in filter(None, os.environ.get(ENV, "").split(",")):
        kind = _load(spec, f"${ENV}")
        kinds.setdefault(kind.name, kind)
    return kinds


def known(name: str) -> list[str]:
    """Why `name` is not an engine kind, as `$.engines.kind: ...`; [] when it is one."""
    names = registry()
    if name in names:
        return []
    return [f"$.engines.kind: got {name!r}, expected one of {', '.join(map(repr, names))}"]


def kind_of(p: Policy) -> Kind:
    return registry()[p.engines.kind]  # `policy_file` admits only registered names


def take_sections(engines: dict[str, Any]) -> tuple[dict[str, Any], Any, list[str]]:
    """The `engines` mapping of a policy file without the kinds' sections; the named kind's
    section as its type (None when it has none or it is wrong); and what is wrong in any
    kind's section, each at its path (`$.engines.vllm.kv_cache_gb: ...`)."""
    rest, errors, section = dict(engines), [], None
    name = engines.get("kind", "holdfast")
    if "section" in rest:
        errors.append("$.engines.section: unknown key; write a kind's settings in engines.<kind>")
        del rest["section"]
    for kind in registry().values():
        if kind.section is None or (kind.name not in rest and kind.name != name):
            continue
        raw = rest.pop(kind.name, {})
        bad = schema.check(raw, kind.section, f"$.engines.{kind.name}")
        errors += bad
        if kind.name == name and not bad:
            section = msgspec.convert(raw, kind.section)
    return rest, section, errors
