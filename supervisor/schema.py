"""Validate plain data against frozen msgspec structs, reporting every error with its path.

msgspec stops at the first error; an operator fixing a policy wants all of them at once.
`check(data, Root)` walks the struct types field by field and returns one line per problem
(`$.engines.standby: expected int, got str`); an empty list means `msgspec.convert` will
succeed.
"""

from __future__ import annotations

import types
import typing
from typing import Any, Literal

import msgspec


def _struct_of(tp: Any) -> type[msgspec.Struct] | None:
    """The struct type inside `tp` (`S`, `S | None`), else None."""
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        structs = [a for a in typing.get_args(tp) if _struct_of(a) is not None]
        return _struct_of(structs[0]) if len(structs) == 1 else None
    return None


def _describe(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _leaf(value: Any, tp: Any, path: str) -> list[str]:
    try:
        msgspec.convert(value, tp)
    except msgspec.ValidationError as e:
        text = str(e)
        where = ""
        if " - at `$" in text:
            text, _, rest = text.partition(" - at `$")
            where = rest.rstrip("`")
        if text.startswith("Invalid enum value") or typing.get_origin(tp) is Literal:
            text = f"got {value!r}, expected {_describe(tp)}"
        text = text.replace("`", "")
        return [f"{path}{where}: {text[:1].lower()}{text[1:]}"]
    return []


def check(data: Any, tp: Any, path: str = "$") -> list[str]:
    """Every problem in `data` as a `tp`, one `$.a.b: message` line each."""
    struct = _struct_of(tp)
    if struct is not None and isinstance(data, dict):
        return _check_struct(data, struct, path)
    if typing.get_origin(tp) is list and isinstance(data, list):
        (item,) = typing.get_args(tp)
        if _struct_of(item) is not None:
            return [e for i, v in enumerate(data) for e in check(v, item, f"{path}[{i}]")]
    return _leaf(data, tp, path)


def _check_struct(data: dict[Any, Any], struct: type[msgspec.Struct], path: str) -> list[str]:
    errors: list[str] = []
    fields = {f.encode_name: f for f in msgspec.structs.fields(struct)}
    hints = typing.get_type_hints(struct)
    for key in data:
        if key not in fields:
            allowed = ", ".join(sorted(fields))
            errors.append(f"{path}.{key}: unknown key; allowed here: {allowed}")
    for key, field in fields.items():
        if key in data:
            errors.extend(check(data[key], hints[field.name], f"{path}.{key}"))
        elif field.default is msgspec.NODEFAULT and field.default_factory is msgspec.NODEFAULT:
            errors.append(f"{path}.{key}: required key is missing")
    return errors


_DROP: Any = object()  # what `_salvage` returns for a value that must go


def salvage(data: Any, tp: Any) -> Any:
    """`data` without what `check` reports (unknown keys dropped, values of a wrong type
    left to their defaults), so the rest converts and the rules between fields can be
    checked too; None when a required key is missing or wrong."""
    out = _salvage(data, tp)
    return None if out is _DROP else out


def _salvage(data: Any, tp: Any) -> Any:
    struct = _struct_of(tp)
    if struct is None or not isinstance(data, dict):
        return data if not check(data, tp) else _DROP
    hints = typing.get_type_hints(struct)
    out: dict[Any, Any] = {}
    for field in msgspec.structs.fields(struct):
        key = field.encode_name
        value = _salvage(data[key], hints[field.name]) if key in data else _DROP
        if value is not _DROP:
            out[key] = value
        elif field.default is msgspec.NODEFAULT and field.default_factory is msgspec.NODEFAULT:
            return _DROP
    return out
