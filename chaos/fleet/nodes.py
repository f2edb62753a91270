"""The fleet's nodes: one `supervisor run` per node namespace, each with its own policy
(the echo engine, the tiny checkpoint, a `cluster:` section naming the node), and a prober
that reads every node's health API from the client namespace.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

from chaos.fleet.net import CLIENT_NS, REPO, Fleet, FleetError, enter, ns_of, signal_ns, wait_gone

ROUTER_PORT, API_PORT = 8000, 8001
ECHO = ["{python}", "-m", "tests.engines.echo"]
PROBE_TIMEOUT_S = 1.0
POLL_S = 0.05  # a node's state is only readable by asking its API: no event to wait on

Status = dict[str, Any]


class NodeOptions:
    """What every node's policy shares."""

    def __init__(
        self,
        checkpoint: Path,
        ttl_s: int,
        cluster: str = "fleet-bench",
        heartbeat_ms: int = 50,
        miss_limit: int = 4,
        standby: int = 1,
    ) -> None:
        self.checkpoint = checkpoint
        self.ttl_s = ttl_s
        self.cluster = cluster
        self.heartbeat_ms = heartbeat_ms
        self.miss_limit = miss_limit
        self.standby = standby


def node_policy(node: str, base: Path, endpoints: list[str], opts: NodeOptions) -> dict[str, Any]:
    addr = Fleet.address(node)
    return {
        "model": {"path": str(opts.checkpoint), "dtype": "float32"},
        "cache": {"runtime_dir": str(base / node / "run"), "spare": False},
        "engines": {"command": ECHO, "standby": opts.standby, "stop_grace_s": 0.5},
        "heartbeat": {"interval_ms": opts.heartbeat_ms, "miss_limit": opts.miss_limit},
        "restart": {"initial_s": 0.05, "max_s": 0.5, "max_restarts": 1000, "window_s": 60},
        "router": {"listen": f"{addr}:{ROUTER_PORT}", "retry_deadline_s": 10.0},
        "api": {"listen": f"{addr}:{API_PORT}"},
        "log": {"level": "info"},
        "cluster": {
            "name": opts.cluster,
            "etcd": endpoints,
            "node": node,
            "ttl_s": opts.ttl_s,
            "priority": 0,
            "prefix": "holdfast",
            "advertise": f"{addr}:{ROUTER_PORT}",
        },
    }


class Node:
    """One node's supervisor, started in its namespace (kept across restarts)."""

    def __init__(self, name: str, base: Path, policy: dict[str, Any]) -> None:
        self.name = name
        self.ns = ns_of(name)
        self.addr = Fleet.address(name)
        self.router = f"{self.addr}:{ROUTER_PORT}"
        self.api = f"http://{self.addr}:{API_PORT}"
        self.dir = base / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.policy_file = self.dir / "policy.yaml"
        self.policy_file.write_text(yaml.safe_dump(policy, sort_keys=False))
        self.log = self.dir / "supervisor.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        with self.log.open("ab") as out:
            out.write(f"--- start {self.starts} at {time.monotonic():.3f}\n".encode())
            self.proc = subprocess.Popen(
                ["ip", "netns", "exec", self.ns, sys.executable, "-m", "supervisor", "run"]
                + [str(self.policy_file)],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.starts += 1

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def kill(self) -> float:
        """SIGKILL every process in the node's namespace; the time it was sent."""
        t = time.monotonic()
        pids = signal_ns(self.ns, signal.SIGKILL)
        self.reap()
        left = wait_gone(pids)
        if left:
            raise FleetError(f"node {self.name}: pids {left} outlived SIGKILL")
        return t

    def reap(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=30)

    def stop(self) -> None:
        """SIGTERM the supervisor (a clean leave), then SIGKILL whatever is left."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=15)
        wait_gone(signal_ns(self.ns, signal.SIGKILL))
        self.reap()

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


class Prober:
    """GET /cluster of every node from the client namespace."""

    def __init__(self, nodes: dict[str, Node]) -> None:
        self.nodes = nodes
        self.pool = ThreadPoolExecutor(
            max_workers=len(nodes), initializer=enter, initargs=(CLIENT_NS,)
        )

    def one(self, node: str) -> Status | None:
        return self.pool.submit(_get, f"{self.nodes[node].api}/cluster").result()

    def all(self) -> dict[str, Status | None]:
        futures = {n: self.pool.submit(_get, f"{x.api}/cluster") for n, x in self.nodes.items()}
        return {n: f.result() for n, f in futures.items()}

    def wait(
        self, pred: Callable[[dict[str, Status | None]], bool], timeout: float, what: str
    ) -> dict[str, Status | None]:
        """Every node's /cluster, once `pred` holds of them; FleetError naming `what` and the
        last views at the deadline."""
        deadline = time.monotonic() + timeout
        while True:
            views = self.all()
            if pred(views):
                return views
            if time.monotonic() > deadline:
                brief = {n: _brief(v) for n, v in views.items()}
                raise FleetError(f"not within {timeout:g} s: {what}; nodes: {brief}")
            time.sleep(POLL_S)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def _get(url: str) -> Status | None:
    try:
        with urllib.request.urlopen(url, timeout=PROBE_TIMEOUT_S) as r:
            out: Status = json.loads(r.read())
            return out
    except urllib.error.HTTPError as e:
        try:
            body: Status = json.loads(e.read())
            return body
        except ValueError:
            return None
    except (OSError, ValueError):
        return None


def _brief(view: Status | None) -> str:
    if view is None:
        return "no answer"
    keys = ("role", "leader", "cluster_epoch", "healthy")
    return ", ".join(f"{k}={view.get(k)}" for k in keys)


def leader_of(views: dict[str, Status | None]) -> tuple[str, int] | None:
    """The leader every answering node agrees on, and its epoch: exactly one node says it
    leads, and every other answering node names it."""
    live = {n: v for n, v in views.items() if v is not None}
    leaders = [n for n, v in live.items() if v.get("role") == "leader"]
    if len(leaders) != 1:
        return None
    lead = leaders[0]
    epoch = int(live[lead].get("epoch") or 0)
    if all(v.get("leader") == lead and v.get("cluster_epoch") == epoch for v in live.values()):
        return lead, epoch
    return None
