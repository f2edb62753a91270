"""Every event the supervisor publishes is an `EventName` member where it is emitted and
where it is compared: no event name is written as a string in supervisor/ or chaos/."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from holdfast_contract.events import EventName

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("supervisor", "chaos")


def literal(node: ast.expr | None) -> bool:
    """A string constant, or a tuple, list or set holding one (`x in ("a", N.B)`)."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return any(literal(e) for e in node.elts)
    return False


def event_of(call: ast.Call) -> ast.expr | None:
    """The event argument of `bus.emit(kind, name, event, epoch, ...)` or of the router's
    `events(event, epoch, ...)` (supervisor/proxy/routing.py `Events`); None for other
    calls."""
    func = call.func
    called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    keyword = next((k.value for k in call.keywords if k.arg == "event"), None)
    if called == "emit":
        return call.args[2] if len(call.args) > 2 else keyword
    if called == "events" and not (isinstance(func, ast.Attribute) and _is(func.value, "sse")):
        return call.args[0] if call.args else keyword
    return None


def _is(node: ast.expr, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def compares_event(cmp: ast.Compare) -> bool:
    """`<x>.event == "..."`, `"..." != <x>.event`, `<x>.event in ("...", ...)`."""
    sides = [cmp.left, *cmp.comparators]
    named = any(isinstance(s, ast.Attribute) and s.attr == "event" for s in sides)
    return named and any(literal(s) for s in sides)


def written_names(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, source) of each emit or comparison that writes an event name as a string."""
    for node in ast.walk(tree):
        call = isinstance(node, ast.Call) and literal(event_of(node))
        if call or (isinstance(node, ast.Compare) and compares_event(node)):
            yield node.lineno, ast.unparse(node)


def emits(tree: ast.AST) -> int:
    return sum(isinstance(n, ast.Call) and event_of(n) is not None for n in ast.walk(tree))


def trees() -> Iterator[tuple[Path, ast.Module]]:
    for top in SOURCES:
        for path in sorted((REPO / top).rglob("*.py")):
            yield path, ast.parse(path.read_text(), str(path))


def test_no_event_name_is_written_as_a_string_in_supervisor_or_chaos() -> None:
    found = [
        f"{path.relative_to(REPO)}:{line}: {code}"
        for path, tree in trees()
        for line, code in written_names(tree)
    ]
    assert not found, "use the holdfast_contract.events.EventName member:\n" + "\n".join(found)
    # the check reads the emits it means: the bus's, the router's and the fleet's
    counted = {str(p.relative_to(REPO)): emits(t) for p, t in trees()}
    assert counted["supervisor/fleet/node.py"] >= 11, counted
    assert counted["supervisor/proxy/cuts.py"] == 3, counted
    assert sum(counted.values()) >= 25, counted


def test_the_check_finds_each_way_a_name_is_written() -> None:
    bad = """
bus.emit("fleet", node, "became-leader", 0)
self.bus.emit("fleet", node, event="health", epoch=0)
self.events("migrated", 1, tokens=3)
if ev.event == "promoted": pass
if "fenced" != e.event: pass
if ev.event in ("dead", N.HUNG): pass
"""
    assert [line for line, _ in written_names(ast.parse(bad))] == [2, 3, 4, 5, 6, 7]
    good = """
bus.emit("fleet", node, N.BECAME_LEADER, 0)
bus.emit("engine", name, f"reported-{state}", 0)
self.events(N.MIGRATED, 1, tokens=3)
for raw in sse.events(buf): pass
if ev.event == N.PROMOTED and ev.kind == "engine": pass
if ev.event in (N.DEAD, N.HUNG): pass
"""
    assert list(written_names(ast.parse(good))) == []


def test_published_values_stay_as_mqtt_consumers_match_them() -> None:
    assert len({e.value for e in EventName}) == len(EventName)
    router = {EventName.MIGRATING, EventName.MIGRATED, EventName.MIGRATION_FAILED}
    assert {e.value for e in router} == {"migrating", "migrated", "migration-failed"}
    fleet = {
        EventName.HEALTH: "health",
        EventName.ETCD_UNREACHABLE: "etcd-unreachable",
        EventName.JOINED: "joined",
        EventName.JOIN_REFUSED: "join-refused",
        EventName.BECAME_LEADER: "became-leader",
        EventName.RESUMED_LEADER: "resumed-leader",
        EventName.STEPPED_DOWN: "stepped-down",
        EventName.LEASE_LOST: "lease-lost",
        EventName.LEADER_VACANT: "leader-vacant",
        EventName.LEADER_ELECTED: "leader-elected",
        EventName.FOLLOWER_OF: "follower-of",
        EventName.STOP: "stop",
    }
    assert {e: e.value for e in fleet} == fleet
