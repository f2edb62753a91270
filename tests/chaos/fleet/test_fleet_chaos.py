"""Fleet faults on a real fleet: 3 nodes in network namespaces (scripts/fleet.sh), a
3-member etcd, a `supervisor run` per node with the echo engine, clients through every
router. A few trials of each fault kind (bench/fleet.py --quick runs the same plan), and
the safety properties asserted on the response log and the nodes' own views:

- never two cluster epochs answering at once (overlap 0), and each epoch one node's;
- 0 failed requests through the routers of surviving nodes, also when the old leader goes
  silent (partition, SIGSTOP): a forwarded request is retried on the next leader;
- a new leader's cluster epoch is larger than the old one's; a killed, cut-off or paused
  node comes back as a follower and does not take leadership back (equal priority); a
  killed node's pool runs on its own cache daemon again, in its own namespace;
- one etcd member down moves nothing; all of them down stops serving, and serving resumes
  under a newer epoch once etcd is back;
- nothing left behind: no namespace, no process.

Timings are the benchmark's business (bench/results/fleet/); nothing here asserts one.
"""

from __future__ import annotations

import subprocess

import pytest

from chaos.fleet.faults import FleetTrial
from chaos.fleet.kinds import FleetConfig
from chaos.fleet.net import missing
from chaos.fleet.run import FleetResults, Step, run_fleet

# one at a time: both build the default-prefix fleet (hf-*, 10.77.0.0/24)
pytestmark = [
    pytest.mark.skipif(missing() is not None, reason=str(missing())),
    pytest.mark.xdist_group("default-fleet"),
]

CONFIG = FleetConfig(ttl_s=1, etcd_flags="--heartbeat-interval 50 --election-timeout 500")
PLAN = [
    Step("kill-node", 2, 0.0),
    Step("partition-node", 1, 3.0),
    Step("kill-etcd-member", 1, 2.0),
    Step("pause-leader-supervisor", 1, 2.0),
    Step("kill-etcd-all", 1, 3.0),
]
MOVES = ("kill-node", "partition-node", "pause-leader-supervisor")
SILENT = ("partition-node", "pause-leader-supervisor")  # the old leader stops answering


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> FleetResults:
    """One fleet run for every test here (about a minute)."""
    if subprocess.run(["ip", "link", "show", "hf-br0"], capture_output=True).returncode == 0:
        pytest.fail("a fleet is up already (hf-br0 exists); run `scripts/fleet.sh down` first")
    return run_fleet(tmp_path_factory.mktemp("fleet"), CONFIG, PLAN)


def violations(trials: list[FleetTrial]) -> list[str]:
    """Every safety property a trial broke, one line each (all of them, not the first)."""
    out = []
    for t in trials:
        head = f"{t.kind} #{t.index} ({t.old_leader}@{t.old_epoch} -> {t.new_leader}@{t.new_epoch})"
        if t.overlap_ms != 0.0 or t.shared_epochs != 0:
            out.append(f"{head}: two epochs answered at once for {t.overlap_ms} ms")
        if t.requests == 0:
            out.append(f"{head}: no request answered during the trial")
        if t.failed_requests and t.kind not in ("kill-etcd-all", *SILENT):
            out.append(f"{head}: {t.failed_requests} failed requests through surviving routers")
        if t.kind in MOVES:
            if t.new_leader == t.old_leader or t.new_epoch <= t.old_epoch:
                out.append(f"{head}: no new leader with a larger epoch")
            if t.failover_ms is None or t.rejoin_ms is None:
                out.append(f"{head}: no failover or no rejoin measured")
            if t.leader_kept is not True:
                out.append(f"{head}: the rejoined node took leadership back ({t.note})")
        if t.kind == "kill-node" and t.own_cache is not True:
            out.append(f"{head}: the restarted node does not serve from its own cache daemon")
        if t.kind == "partition-node" and t.stepped_down_ms is None:
            out.append(f"{head}: the cut-off leader never stepped down")
        if t.kind == "kill-etcd-member" and (
            t.leader_changes or (t.new_leader, t.new_epoch) != (t.old_leader, t.old_epoch)
        ):
            out.append(f"{head}: a raft follower's loss moved the leader")
        if t.kind == "kill-etcd-all":
            if t.stopped_serving_ms is None or t.serve_again_ms is None:
                out.append(f"{head}: did not stop serving, or did not serve again")
            # served again by the same term taken up again (etcd restored the leases
            # from disk and extended them), or by a new election: never an older epoch,
            # nor the same epoch on another node
            same_term = (t.new_leader, t.new_epoch) == (t.old_leader, t.old_epoch)
            if not same_term and t.new_epoch <= t.old_epoch:
                out.append(f"{head}: served again under an epoch no newer than before")
    return out


def test_fleet_faults_keep_one_leader_and_lose_nothing(results: FleetResults) -> None:
    assert results.errors == [], results.errors
    assert results.figures["left_behind"] == []
    ip = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert [ln for ln in ip.splitlines() if ln.startswith("hf-")] == []
    assert [t.kind for t in results.trials] == [s.kind for s in PLAN for _ in range(s.trials)]
    assert results.figures["overlap_ms_whole_run"] == 0.0
    assert results.figures["epochs_answered_by_two_nodes"] == 0
    assert violations(results.trials) == []


def test_no_request_lost_when_the_leader_goes_silent(results: FleetResults) -> None:
    lost = {f"{t.kind} #{t.index}": t.failed_requests for t in results.trials if t.kind in SILENT}
    assert lost and all(n == 0 for n in lost.values()), lost
