"""docs/supervisor.md's policy table has one row per key of the schema in
supervisor/policy.py and of each built-in engine kind's section (`engines.<kind>`,
supervisor/kinds/), and no row for a key that does not exist; where a default is a number,
a bool or a word, the row says the schema's."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import msgspec

from supervisor.kinds import BUILTIN
from supervisor.policy import Policy
from tests.engines.harness import REPO

ROW = re.compile(r"^\| `([\w.\[\]]+)` \| ([^|]*) \|")


def schema_keys(struct: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Every leaf key of the policy (`engines.batch[].name`), with its default."""
    for field in msgspec.inspect.type_info(struct).fields:
        name = prefix + field.encode_name
        inner = field.type
        if isinstance(inner, msgspec.inspect.UnionType):  # X | None, or a leaf's choices
            some = [t for t in inner.types if not isinstance(t, msgspec.inspect.NoneType)]
            inner = some[0] if len(some) == 1 else inner
        if isinstance(inner, msgspec.inspect.ListType) and isinstance(
            inner.item_type, msgspec.inspect.StructType
        ):
            yield from schema_keys(inner.item_type.cls, name + "[].")
        elif isinstance(inner, msgspec.inspect.StructType):
            yield from schema_keys(inner.cls, name + ".")
        elif field.default_factory is not msgspec.NODEFAULT:
            yield name, field.default_factory()
        else:
            yield name, field.default


def policy_keys() -> Iterator[tuple[str, Any]]:
    """The schema's keys, `engines.section` (the kind's, set from `engines.<kind>`) put
    as each built-in kind's own keys."""
    yield from ((k, v) for k, v in schema_keys(Policy) if k != "engines.section")
    for kind in BUILTIN:
        if kind.section is not None:
            yield from schema_keys(kind.section, f"engines.{kind.name}.")


def table() -> dict[str, str]:
    text = (REPO / "docs" / "supervisor.md").read_text()
    section = text[text.index("## Policy") : text.index("Command templates may use")]
    return {
        m.group(1): m.group(2).strip() for line in section.splitlines() if (m := ROW.match(line))
    }


def shown(default: Any) -> str | None:
    """A default as the table writes it, for the kinds of default it can be checked on."""
    if isinstance(default, bool):
        return str(default).lower()
    if isinstance(default, int | float):
        return f"{default:g}"
    if isinstance(default, str) and default:
        return default
    return None


def test_every_schema_key_has_one_row_and_every_row_is_a_key() -> None:
    keys = dict(policy_keys())
    rows = table()
    assert sorted(set(keys) - set(rows)) == [], "keys without a row"
    assert sorted(set(rows) - set(keys)) == [], "rows of no key"


def test_the_rows_give_the_schema_defaults() -> None:
    rows = table()
    for key, default in policy_keys():
        if default is msgspec.NODEFAULT:
            assert rows[key] == "required", key
        elif default is None:
            assert rows[key] == "unset", key
        elif (text := shown(default)) is not None:
            assert rows[key] == text, key
