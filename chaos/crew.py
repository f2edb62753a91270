"""Whether the crew is as whole as the policy wants it *now*, and what it still lacks.

The supervisor publishes what its rules want of each engine (`EngineStatus.wanted`, decided
by `supervisor.decisions.BatchGovernor.wants`): a batch engine it wants stopped (the load
rule, an eviction by hand, the memory cap) is not missing, so it never holds a trial up.
One it quarantined is: the crew has lost it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from supervisor.policy import Policy

if TYPE_CHECKING:
    from holdfast_contract.control import CrewStatus, EngineStatus


def kept_out(engine: EngineStatus) -> str | None:
    """Why the supervisor keeps this batch engine out now, as it says (its `wanted`), or
    None when the crew should have it: wanted running (on its way, after a backoff or a
    respawn hold), quarantined (lost), or not yet decided about."""
    w = engine.wanted
    if engine.role != "batch" or w is None or w.state == "running" or w.reason == "quarantined":
        return None
    return f"{w.reason}: {w.detail}"


def missing(view: CrewStatus, policy: Policy, standbys: int | None = None) -> list[str]:
    """What the crew lacks for the policy as it stands now; empty when it is whole.
    `standbys`: that many ready standbys are enough (None: every one the policy wants)."""
    out: list[str] = []
    if view.primary is None or len(view.in_state("primary")) != 1:
        out.append("a primary (none serving)")
    ready = view.in_state("standby")
    want = policy.engines.standby if standbys is None else min(standbys, policy.engines.standby)
    if len(ready) < want:
        out.append(
            f"standby {len(ready)}/{want} ready" + _others(view, "standby", {e.name for e in ready})
        )
    batch = [e for e in view.engines if e.role == "batch"]
    wanted = [e for e in batch if kept_out(e) is None]
    running = [e for e in wanted if e.state == "batch" and e.pid]
    if len(running) < len(wanted):
        out.append(
            f"batch {len(running)}/{len(wanted)} running"
            + _others(view, "batch", {e.name for e in running})
        )
    if len(view.daemons) != policy.model.tp_size:
        out.append(f"daemons {len(view.daemons)}/{policy.model.tp_size} listed")
    out += [f"daemon {d.rank} {d.state}" for d in view.daemons if d.state != "serving" or not d.pid]
    return out


def _others(view: CrewStatus, role: str, ready: set[str]) -> str:
    rest = [f"{e.name} {e.state}" for e in view.engines if e.role == role and e.name not in ready]
    return f" ({', '.join(rest)})" if rest else ""


def absent_batch(view: CrewStatus) -> str | None:
    """Why no batch engine runs now, when the supervisor keeps every one out; else None."""
    batch = [e for e in view.engines if e.role == "batch"]
    reasons = [kept_out(e) for e in batch]
    if not batch or any(r is None for r in reasons):
        return None
    return f"every batch engine is kept out by the supervisor ({batch[0].name} {reasons[0]})"


def coming_batch(view: CrewStatus) -> list[str]:
    """Batch engines on their way: starting, or out and wanted running (after their
    backoff, or once the load has stayed low for respawn_hold_s)."""
    return [f"{e.name} {e.state}" for e in view.engines if e.role == "batch" and _coming(e)]


def _coming(e: EngineStatus) -> bool:
    w = e.wanted
    return e.state == "starting" or (
        w is not None and w.state == "running" and e.state in ("evicted", "dead")
    )
