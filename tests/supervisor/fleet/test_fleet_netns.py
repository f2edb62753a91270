"""The election across real network namespaces: scripts/fleet.sh builds 3 nodes and a
3-member etcd, one elector process runs in each node, and the leader's node is cut off.

Every time compared here is CLOCK_MONOTONIC, which all namespaces of the machine share.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from chaos.fleet.net import missing
from supervisor.fleet_spec import ClusterSpec
from tests.conftest import REPO, child_env

FLEET = REPO / "scripts" / "fleet.sh"
DEADLINE = 60.0
TTL = 2
# scheduling slack on two busy cores: etcd's own expiry check, the watch, one campaign
SLACK_S = 2.0


# one at a time: both build the default-prefix fleet (hf-*, 10.77.0.0/24)
pytestmark = [
    pytest.mark.skipif(missing() is not None, reason=str(missing())),
    pytest.mark.xdist_group("default-fleet"),
]


def fleet(*args: str, state: Path, check: bool = True) -> str:
    env = {**os.environ, "HF_FLEET_STATE": str(state)}
    done = subprocess.run(
        ["bash", str(FLEET), *args], env=env, capture_output=True, text=True, timeout=120
    )
    if check and done.returncode != 0:
        raise AssertionError(f"fleet.sh {' '.join(args)}: {done.stderr}")
    return done.stdout


def leftovers(state: Path, pids: list[int]) -> list[str]:
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    found = [line.split()[0] for line in netns.splitlines() if line.startswith("hf-")]
    found += [w for line in links.splitlines() for w in line.split()[1:2] if w.startswith("hf")]
    found += [f"pid {p}" for p in pids if _alive(p)]
    return found + ([str(state)] if state.exists() else [])


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture
def state(tmp_path: Path) -> Iterator[Path]:
    if subprocess.run(["ip", "link", "show", "hf-br0"], capture_output=True).returncode == 0:
        pytest.fail("a fleet is up already (hf-br0 exists); run `scripts/fleet.sh down` first")
    path = tmp_path / "fleet"
    try:
        yield path
    finally:
        fleet("down", state=path, check=False)


Line = dict[str, Any]


class Electors:
    """`python -m supervisor.fleet elect` inside each node's namespace; every JSON line
    they print kept in one list, in arrival order, with the node that printed it."""

    def __init__(self, nodes: list[str], endpoints: str, state: Path) -> None:
        self.lines: list[Line] = []
        self._cond = threading.Condition()
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.pumps: list[threading.Thread] = []
        env = {**child_env(), "HF_FLEET_STATE": str(state)}
        for node in nodes:
            argv = ["bash", str(FLEET), "exec", node, "python3", "-m", "supervisor.fleet"]
            argv += ["elect", "--etcd", endpoints, "--cluster", "netns", "--node", node]
            argv += ["--fingerprint", "fp-netns", "--ttl", str(TTL)]
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
            self.procs[node] = proc
            pump = threading.Thread(target=self._pump, args=(proc,), daemon=True)
            pump.start()
            self.pumps.append(pump)

    def _pump(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            with self._cond:
                self.lines.append(json.loads(raw))
                self._cond.notify_all()
        proc.stdout.close()

    def wait(self, what: str, **match: Any) -> Line:
        """The first line with `event` == what (and every `match` key equal; `after`: a
        time it must follow), waiting for it."""
        after = match.pop("after", 0.0)

        def find() -> Line | None:
            return next(
                (
                    x
                    for x in self.lines
                    if x["event"] == what
                    and x["t"] > after
                    and all(x[k] == v for k, v in match.items())
                ),
                None,
            )

        with self._cond:
            if not self._cond.wait_for(lambda: find() is not None, DEADLINE):
                raise AssertionError(f"no {what} {match} after {after}: {self.lines[-20:]}")
            return find() or {}

    def terms(self) -> list[tuple[float, float, str]]:
        """Every leadership as (won, stepped down, node); an open one ends at +inf."""
        out, start = [], {}
        with self._cond:
            lines = list(self.lines)
        for x in lines:
            if x["event"] == "won":
                start[x["node"]] = x["t"]
            elif x["event"].startswith("stepped_down") and x["node"] in start:
                out.append((start.pop(x["node"]), x["t"], x["node"]))
        return sorted(out + [(t, float("inf"), n) for n, t in start.items()])

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            proc.wait(timeout=DEADLINE)
        for pump in self.pumps:
            pump.join(timeout=DEADLINE)


def test_isolated_leader_steps_down_and_the_others_elect(state: Path) -> None:
    out = fleet("up", "3", state=state)
    endpoints = out.strip().splitlines()[-1].removeprefix("HF_FLEET_ETCD=")
    assert len(endpoints.split(",")) == 3
    health = fleet("health", state=state).split()
    assert health == ["e1", "healthy", "e2", "healthy", "e3", "healthy"]
    url = f"http://{endpoints.split(',')[0]}/v3/cluster/member/list"
    ask = f"import urllib.request; print(urllib.request.urlopen({url!r}, b'{{}}').read().decode())"
    members = fleet("exec", "n1", "python3", "-c", ask, state=state)
    assert len(json.loads(members)["members"]) == 3, members
    pids = [int(p.read_text()) for p in state.glob("e*/pid")]
    spec = ClusterSpec("netns", endpoints.split(","), "n1", TTL)

    electors = Electors(["n1", "n2", "n3"], endpoints, state)
    try:
        won = electors.wait("won")
        old = won["node"]
        cut = time.monotonic()
        fleet("isolate", old, state=state)

        down = electors.wait("stepped_down.renewal_stale", node=old, after=won["t"])
        new = electors.wait("won", after=cut)
        # the isolated leader stopped serving before its lease could expire ...
        assert down["t"] < down["lease_deadline"]
        # ... and before any other node was elected: never two leaders at once
        assert down["t"] < new["t"] and new["node"] != old
        assert new["epoch"] > won["epoch"]
        assert new["t"] - cut < spec.ttl_s + spec.margin_s + SLACK_S, new["t"] - cut
        terms = electors.terms()
        assert all(a[1] <= b[0] for a, b in zip(terms, terms[1:], strict=False)), terms

        fleet("rejoin", old, state=state)
        # it follows the new leader: in the session it had if its lease outlived the cut
        # (the new leader freed the key, not the lease), else in a new one
        seen = electors.wait("leader", node=old, after=new["t"], leader=new["node"])
        assert seen["role"] == "follower" and seen["cluster_epoch"] == new["epoch"]
    finally:
        electors.stop()
    assert [t for t in electors.terms() if t[1] == float("inf")] == []
    fleet("down", state=state)
    assert leftovers(state, pids) == []
    fleet("down", state=state)  # again: nothing to do, no error
