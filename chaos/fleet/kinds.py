"""What a scenario may say about a fleet: the fault kinds and the `fleet:` section. Kept
apart from the harness so that validating a scenario imports nothing that runs a fleet."""

from __future__ import annotations

import msgspec

FLEET_FAULTS: dict[str, str] = {
    "kill-node": "SIGKILL every process in the leader node's namespace, then start it again",
    "partition-node": "cut the leader node off the network for hold_s, then rejoin it",
    "kill-etcd-member": "SIGKILL one etcd member of three (in turn) for hold_s, then restart it",
    "kill-etcd-all": "SIGKILL all three etcd members for hold_s, then restart them",
    "pause-leader-supervisor": "SIGSTOP the leader node's supervisor for hold_s, then SIGCONT",
}
FLEET_METRICS: dict[str, str] = {
    "failover_ms": "fleet fault -> first answer of a newer cluster epoch via a surviving router",
    "stopped_serving_ms": "fleet fault -> last answer under the old cluster epoch",
    "stepped_down_ms": "partition -> the cut-off leader no longer says it leads",
    "serve_again_ms": "etcd back (kill-etcd-all) -> first answer",
    "rejoin_ms": "restart, reconnect or SIGCONT -> the victim a healthy follower of the leader",
    "overlap_ms": "how long two cluster epochs certainly answered at once (must be 0)",
    "failed_elsewhere": "failed requests of clients of the victim's own router (not counted)",
    "leader_changes": "newer cluster epochs that answered during the trial",
}

# the kinds each timing is measured for (a trial of one of them without it: never a pass)
MEASURED_BY: dict[str, frozenset[str]] = {
    "failover_ms": frozenset({"kill-node", "partition-node", "pause-leader-supervisor"}),
    "stopped_serving_ms": frozenset({"partition-node", "kill-etcd-all"}),
    "stepped_down_ms": frozenset({"partition-node"}),
    "serve_again_ms": frozenset({"kill-etcd-all"}),
    "rejoin_ms": frozenset(
        {"kill-node", "partition-node", "pause-leader-supervisor", "kill-etcd-member"}
    ),
}
# what a fleet run measures: the fleet metrics per trial, and of the run
FLEET_TRIAL_METRICS = frozenset({*FLEET_METRICS, "failed_requests"})
FLEET_RUN_METRICS = frozenset({"requests", "failed_requests", "lingering_processes"})


class FleetConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The fleet a run builds (a scenario's `fleet:` section)."""

    nodes: int = 3
    ttl_s: int = 2
    etcd_flags: str = ""  # e.g. "--heartbeat-interval 50 --election-timeout 500"
    client_interval_ms: float = 25.0  # each client: one request, then this pause
    observe_s: float | None = None  # after a rejoin, the leader must stay put; None: 1.25 x ttl_s


def config_problems(raw: object) -> list[str]:
    """Range checks of a scenario's `fleet:` section (its shape is the schema's)."""
    fleet = raw.get("fleet") if isinstance(raw, dict) else None
    if not isinstance(fleet, dict):
        return []
    problems = []
    nodes, ttl = fleet.get("nodes"), fleet.get("ttl_s")
    if isinstance(nodes, int) and not 2 <= nodes <= 9:
        problems.append(f"$.fleet.nodes: {nodes} is out of range (2 to 9: a leader and followers)")
    if isinstance(ttl, int) and ttl < 1:
        problems.append(f"$.fleet.ttl_s: {ttl} is out of range (1 or more whole seconds)")
    interval = fleet.get("client_interval_ms")
    if isinstance(interval, int | float) and interval < 1:
        problems.append(f"$.fleet.client_interval_ms: {interval} is out of range (1 or more)")
    return problems


def check_problems(metrics: list[tuple[str, str, bool]], fleet: bool) -> list[str]:
    """Checks a run of this shape cannot evaluate: (text, metric, per trial) of each."""
    problems = []
    for text, metric, per_trial in metrics:
        if fleet:
            allowed = FLEET_TRIAL_METRICS if per_trial else FLEET_RUN_METRICS
            if metric not in allowed:
                problems.append(
                    f"$.checks: {text!r}: a fleet run does not measure {metric!r}; "
                    f"it measures {', '.join(sorted(allowed))}"
                )
        elif metric in FLEET_METRICS:
            problems.append(
                f"$.checks: {text!r}: {metric!r} is measured by fleet runs only (a `fleet:` "
                "section); drop the check"
            )
    return problems
