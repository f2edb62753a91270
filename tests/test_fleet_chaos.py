"""Fleet faults on a real fleet: 3 nodes in network namespaces (scripts/fleet.sh), a
3-member etcd, a `supervisor run` per node with the echo engine, clients through every
router. A few trials of each fault kind (bench/fleet.py --quick runs the same plan), and
the safety properties asserted on the response log and the nodes' own views:

- never two cluster epochs answering at once (overlap 0), and each epoch one node's;
- 0 failed requests through the routers of surviving nodes;
- a new leader's cluster epoch is larger than the old one's; a killed, cut-off or paused
  node comes back as a follower and does not take leadership back (equal priority);
- one etcd member down moves nothing; all of them down stops serving, and serving resumes
  under a newer epoch once etcd is back;
- nothing left behind: no namespace, no process.

Timings are the benchmark's business (bench/results/fleet/); nothing here asserts one.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from chaos.fleet.kinds import FleetConfig
from chaos.fleet.net import missing
from chaos.fleet.run import Step, run_fleet

pytestmark = pytest.mark.skipif(missing() is not None, reason=str(missing()))

CONFIG = FleetConfig(ttl_s=1, etcd_flags="--heartbeat-interval 50 --election-timeout 500")
PLAN = [
    Step("kill-node", 2, 0.0),
    Step("partition-node", 1, 3.0),
    Step("kill-etcd-member", 1, 2.0),
    Step("pause-leader-supervisor", 1, 2.0),
    Step("kill-etcd-all", 1, 3.0),
]
MOVES = ("kill-node", "partition-node", "pause-leader-supervisor")


def test_fleet_faults_keep_one_leader_and_lose_nothing(tmp_path: Path) -> None:
    if subprocess.run(["ip", "link", "show", "hf-br0"], capture_output=True).returncode == 0:
        pytest.fail("a fleet is up already (hf-br0 exists); run `scripts/fleet.sh down` first")
    results = run_fleet(tmp_path, CONFIG, PLAN)
    assert results.errors == [], results.errors
    assert results.figures["left_behind"] == []
    trials = results.trials
    assert [t.kind for t in trials] == [s.kind for s in PLAN for _ in range(s.trials)]
    assert results.figures["overlap_ms_whole_run"] == 0.0
    assert results.figures["epochs_answered_by_two_nodes"] == 0
    for t in trials:
        assert t.overlap_ms == 0.0 and t.shared_epochs == 0, t
        assert t.requests > 0, t
    for t in (t for t in trials if t.kind in MOVES):
        assert t.failed_requests == 0, t  # retried before the first byte by the routers
        assert t.new_leader != t.old_leader and t.new_epoch > t.old_epoch, t
        assert t.failover_ms is not None and t.rejoin_ms is not None, t
        assert t.leader_kept is True, t
    part = next(t for t in trials if t.kind == "partition-node")
    assert part.stepped_down_ms is not None and part.stopped_serving_ms is not None
    member = next(t for t in trials if t.kind == "kill-etcd-member")
    assert member.failed_requests == 0 and member.leader_changes == 0, member
    assert (member.new_leader, member.new_epoch) == (member.old_leader, member.old_epoch)
    outage = next(t for t in trials if t.kind == "kill-etcd-all")
    assert outage.stopped_serving_ms is not None and outage.serve_again_ms is not None, outage
    assert outage.new_epoch > outage.old_epoch, outage  # a stale lease is a new election
    ip = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert [ln for ln in ip.splitlines() if ln.startswith("hf-")] == []
