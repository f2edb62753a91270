"""A running fleet under load: namespaces and etcd (fleet.sh), a supervisor per node, the
prober, and two clients per node (one in the client namespace, one inside the node's own
namespace, both to that node's router). `scripts/fleet.sh down` always runs at the end.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from chaos.fleet.load import Clients
from chaos.fleet.net import CLIENT_NS, Fleet, FleetError, alive, in_ns, ns_pids
from chaos.fleet.nodes import Node, NodeOptions, Prober, Status, _get, leader_of, node_policy

START_TIMEOUT_S = 120.0


class FleetRun:
    def __init__(
        self,
        base: Path,
        opts: NodeOptions,
        *,
        nodes: int = 3,
        etcd_flags: str = "",
        interval_s: float = 0.025,
        base_policy: dict[str, Any] | None = None,
    ) -> None:
        self.base = base
        self.opts = opts
        self.count = nodes
        self.fleet = Fleet(base / "state", etcd_flags)
        self.interval_s = interval_s
        self.base_policy = base_policy or {}
        self.nodes: dict[str, Node] = {}
        self.clients = Clients(interval_s)
        self.outside: dict[str, int] = {}  # node -> its client in the client namespace
        self.inside: dict[str, int] = {}  # node -> its client inside its own namespace
        self.prober: Prober | None = None
        self.started = 0.0
        self.etcd_kills = 0  # kill-etcd-member trials so far (every second takes the raft leader)

    def __enter__(self) -> FleetRun:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _start(self) -> None:
        self.fleet.up(self.count)
        for name in self.fleet.nodes:
            policy = _merge(
                self.base_policy, node_policy(name, self.base, self.fleet.endpoints, self.opts)
            )
            policy["model"].pop("preset", None)  # the checkpoint made once replaces it
            self.nodes[name] = Node(name, self.base, policy)
        self.started = time.monotonic()
        for node in self.nodes.values():
            node.start()
        self.prober = Prober(self.nodes)
        self.steady(START_TIMEOUT_S)
        for name, node in self.nodes.items():
            self.outside[name] = self.clients.add(CLIENT_NS, name, node.router)
            self.inside[name] = self.clients.add(node.ns, name, node.router)

    @property
    def probe(self) -> Prober:
        if self.prober is None:
            raise FleetError("the fleet is not up")
        return self.prober

    def steady(self, timeout: float, among: list[str] | None = None) -> tuple[str, int]:
        """The leader and its epoch once every node of `among` (default: all) answers, is
        healthy, and agrees on one leader."""
        names = among or list(self.nodes)

        def whole(views: dict[str, Status | None]) -> bool:
            mine = {n: views[n] for n in names}
            if any(v is None or not v.get("healthy") for v in mine.values()):
                return False
            return leader_of(mine) is not None

        views = self.probe.wait(whole, timeout, f"one leader agreed by {', '.join(names)}")
        found = leader_of({n: views[n] for n in names})
        assert found is not None
        return found

    def follower_of(self, node: str, leader: str, epoch: int, timeout: float) -> float:
        """When `node` (probed from its own namespace, which may be cut off) reports itself
        a healthy follower of `leader` at `epoch`."""
        url = f"{self.nodes[node].api}/cluster"
        deadline = time.monotonic() + timeout
        while True:
            view = in_ns(self.nodes[node].ns, lambda: _get(url))
            if (
                view is not None
                and view.get("role") == "follower"
                and view.get("leader") == leader
                and view.get("cluster_epoch") == epoch
                and view.get("healthy")
            ):
                return time.monotonic()
            if time.monotonic() > deadline:
                raise FleetError(
                    f"node {node} not a healthy follower of {leader} (epoch {epoch}) within "
                    f"{timeout:g} s; it says {view}; log: {self.nodes[node].log}"
                )
            time.sleep(0.05)  # the node's state is only readable by asking its API

    def own_cache(self, node: str) -> bool:
        """Whether `node`'s pool runs on its own cache: its /cluster lists a serving cache
        daemon, and every daemon and engine process it lists lives in the node's namespace."""
        view = in_ns(self.nodes[node].ns, lambda: _get(f"{self.nodes[node].api}/cluster"))
        if view is None or not view.get("daemons"):
            return False
        mine = set(ns_pids(self.nodes[node].ns))
        daemons = view["daemons"]
        pids = [d["pid"] for d in daemons] + [e["pid"] for e in view.get("engines", []) if e["pid"]]
        return all(d["state"] == "serving" for d in daemons) and set(pids) <= mine

    def role_of(self, node: str) -> str | None:
        """`node`'s role as it reports it, asked from its own namespace."""
        view = in_ns(self.nodes[node].ns, lambda: _get(f"{self.nodes[node].api}/cluster"))
        return None if view is None else str(view.get("role"))

    def pause_clients(self, node: str) -> None:
        self.clients.pause(self.outside[node])
        self.clients.pause(self.inside[node])

    def resume_clients(self, node: str) -> None:
        self.clients.resume(self.outside[node])
        self.clients.resume(self.inside[node])

    def repair(self, timeout: float) -> list[str]:
        """After a trial that failed midway: every node linked, running and not stopped,
        every etcd member up, every client sending; then one leader agreed. What was done."""
        done = []
        for i in range(1, 4):
            if not alive(self.fleet.member_pid(i)):
                self.fleet.start_member(i)
                done.append(f"etcd e{i} started")
        for name, node in self.nodes.items():
            self.fleet.rejoin(name)  # idempotent: up is up
            pid = node.pid
            if pid is None:
                node.stop()  # whatever the dead supervisor left in the namespace
                node.start()
                done.append(f"{name} started again (it had exited: see {node.log})")
            else:
                os.kill(pid, signal.SIGCONT)
            self.resume_clients(name)
        self.steady(timeout)
        return done

    def close(self) -> None:
        """Clients, supervisors, namespaces and etcd: all of it, whatever failed."""
        try:
            self.clients.close()
            if self.prober is not None:
                self.prober.close()
            for node in self.nodes.values():
                node.stop()
        finally:
            self.fleet.down()


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        old = out.get(key)
        out[key] = (
            _merge(old, value) if isinstance(old, dict) and isinstance(value, dict) else value
        )
    return out
