"""Whether the pool is as whole as the policy wants it *now*, and what it still lacks.

The load rule (`engines.load`) keeps batch engines out while the primary is busy: above
`evict_above` it evicts them (and does not restart a crashed one), and it brings an evicted
one back only once the load fell below `respawn_below`. A batch engine kept out by that rule
is not missing, so it never holds a trial up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from supervisor.policy import Policy

if TYPE_CHECKING:
    from holdfast_contract.control import ClusterStatus, EngineStatus

RUNNING = frozenset({"starting", "standby", "primary", "batch", "draining"})


def primary_load(view: ClusterStatus) -> int:
    """The primary's requests in flight (queued ones included), as its last heartbeat said:
    the figure the supervisor's load rule reads."""
    primary = view.engine(view.primary or "")
    return primary.in_flight if primary is not None else 0


def kept_out(engine: EngineStatus, view: ClusterStatus, policy: Policy) -> str | None:
    """Why the load rule keeps this batch engine out now, or None when it should run."""
    if engine.role != "batch" or engine.state in RUNNING:
        return None
    rule, load = policy.engines.load, primary_load(view)
    if load > rule.evict_above:
        return f"primary load {load} > engines.load.evict_above {rule.evict_above}"
    if engine.state == "evicted" and load >= rule.respawn_below:
        return f"evicted; primary load {load} >= engines.load.respawn_below {rule.respawn_below}"
    return None


def missing(view: ClusterStatus, policy: Policy, standbys: int | None = None) -> list[str]:
    """What the pool lacks for the policy as it stands now; empty when it is whole.
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
    wanted = [e for e in batch if kept_out(e, view, policy) is None]
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


def _others(view: ClusterStatus, role: str, ready: set[str]) -> str:
    rest = [f"{e.name} {e.state}" for e in view.engines if e.role == role and e.name not in ready]
    return f" ({', '.join(rest)})" if rest else ""


def absent_batch(view: ClusterStatus, policy: Policy) -> str | None:
    """Why no batch engine runs now, when the load rule is the reason; else None."""
    batch = [e for e in view.engines if e.role == "batch"]
    reasons = [kept_out(e, view, policy) for e in batch]
    if not batch or any(r is None for r in reasons):
        return None
    return f"every batch engine is out by the load rule ({reasons[0]})"


def coming_batch(view: ClusterStatus) -> list[str]:
    """Batch engines on their way back: evicted (the load rule brings them back once the
    load has stayed low for respawn_hold_s) or starting."""
    return [
        f"{e.name} {e.state}"
        for e in view.engines
        if e.role == "batch" and e.state in ("evicted", "starting")
    ]
