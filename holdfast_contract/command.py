"""Engine command templates: the placeholders a policy's `engines.command` may use.

A policy writes an engine command as a list of arguments with `{placeholder}`s
(`["{python}", "-m", "engine", "--port", "{port}"]`); the supervisor fills them in for each
engine process from one `Placeholders`. Policy validation and the launcher both use this.
"""

from __future__ import annotations

import string

import msgspec

# commands an engine fork server can start: `python -m engine ...`
FORKABLE: tuple[str, ...] = ("{python}", "-m", "engine")


class Placeholders(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    python: str  # the interpreter the supervisor runs on
    name: str
    role: str
    port: str
    epoch: str
    model: str
    agent: str
    daemons: str  # comma-separated, one per rank
    rank: str
    world_size: str
    device: str
    run: str


PLACEHOLDERS: frozenset[str] = frozenset(Placeholders.__struct_fields__)


def template_errors(path: str, command: list[str]) -> list[str]:
    """One `path[i]: ...` line per argument that is not a valid template over PLACEHOLDERS."""
    errors = []
    for i, arg in enumerate(command):
        try:
            keys = {k for _, k, _, _ in string.Formatter().parse(arg) if k is not None}
        except ValueError as exc:
            errors.append(f"{path}[{i}]: bad template {arg!r}: {exc}")
            continue
        for key in sorted(keys - PLACEHOLDERS):
            errors.append(
                f"{path}[{i}]: unknown placeholder {{{key}}}; "
                f"known: {', '.join(sorted(PLACEHOLDERS))}"
            )
    return errors


def render(command: list[str] | tuple[str, ...], values: Placeholders) -> list[str]:
    """`command` with every placeholder filled in."""
    fill = msgspec.structs.asdict(values)
    return [arg.format(**fill) for arg in command]


def is_forkable(command: list[str]) -> bool:
    """Whether `command` starts `{python} -m engine` (a fork server can start it)."""
    return tuple(command[: len(FORKABLE)]) == FORKABLE
