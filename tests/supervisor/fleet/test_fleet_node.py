"""`supervisor run` with a `cluster:` section: real supervisors (echo engines, a real cache
daemon each) on loopback, electing through a real etcd. Two nodes elect one leader and a
follower's router forwards to it; the leader's whole process tree killed, the other node
leads with a larger cluster epoch; a single-node policy is unchanged; unreachable etcd
and a duplicate node name. Waits are on the supervisors' events, or polls of their health
APIs with a condition."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from holdfast_contract.events import Event
from holdfast_contract.wire import free_port
from supervisor.fleet.node import term_floor
from tests.engines.harness import Supervisor, get, write_policy
from tests.fleet_etcd import Etcd
from tests.supervisor.test_supervisor_mqtt import PREFIX, Broker, Subscriber

DEADLINE = 90.0  # generous: two shared cores


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Etcd]:
    server = Etcd(tmp_path_factory.mktemp("etcd"))
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def mqtt(tmp_path: Path) -> Iterator[Broker]:
    """A mosquitto of our own on a free port; a test names it before `started`, so its
    supervisors stop (publishing their offline states) while it still runs."""
    b = Broker(free_port(), tmp_path / "broker")
    b.start()
    try:
        yield b
    finally:
        b.stop()


@pytest.fixture
def started() -> Iterator[list[Supervisor]]:
    sups: list[Supervisor] = []
    try:
        yield sups
    finally:
        for s in sups:
            s.stop()


def node(
    base: Path, checkpoint: Path, name: str, cluster: dict[str, Any] | None, **sections: Any
) -> Supervisor:
    d = base / name
    d.mkdir()
    extra = {"cluster": {"node": name, **cluster}} if cluster is not None else {}
    return Supervisor(write_policy(d / "policy.yaml", checkpoint, d / "run", **extra, **sections))


def fleet_event(event: str, **data: Any) -> Callable[[Event], bool]:
    return lambda ev: (
        ev.kind == "fleet"
        and ev.event == event
        and all(ev.data.get(k) == v for k, v in data.items())
    )


def ask(
    router: str, headers: dict[str, str] | None = None, **extra: Any
) -> tuple[int, dict[str, str], dict[str, Any]]:
    """POST a completion; status, response headers, body."""
    req = urllib.request.Request(
        f"{router}/v1/completions",
        data=json.dumps({"prompt": "hi", **extra}).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=DEADLINE) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), {"error": e.read().decode(errors="replace")}


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rpartition(")")[2].split()[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_all(sup: Supervisor) -> list[int]:
    """SIGKILL the supervisor and every process under it, frozen first so none is added."""
    os.kill(sup.proc.pid, signal.SIGSTOP)
    tree = descendants(sup.proc.pid)
    os.kill(sup.proc.pid, signal.SIGKILL)
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):  # one that exited since the listing
            os.kill(pid, signal.SIGKILL)
    sup.proc.wait(30)
    return tree


def metric(api: str, name: str) -> float:
    with urllib.request.urlopen(f"{api}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"no {name} in {api}/metrics")


def running_in(run: Path) -> list[str]:
    """Command lines of live processes that name the runtime dir `run`."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if str(run) in cmd:
                found.append(cmd)
    return found


def leader_of(a: Supervisor, b: Supervisor) -> tuple[Supervisor, Supervisor, Event]:
    """Once both nodes see the same leader: (leader, follower, the follower's event)."""
    seen_a = a.wait(fleet_event("leader-elected"), timeout=DEADLINE)
    name = seen_a.data["leader"]
    seen_b = b.wait(fleet_event("leader-elected", leader=name), timeout=DEADLINE)
    return (a, b, seen_b) if seen_a.name == name else (b, a, seen_a)


def test_two_nodes_elect_one_and_the_follower_routes_to_the_leader(
    tmp_path: Path, tiny_model: Path, etcd: Etcd, mqtt: Broker, started: list[Supervisor]
) -> None:
    cluster = {"name": f"two-{uuid.uuid4().hex[:6]}", "etcd": [etcd.endpoint]}
    prefix = f"{PREFIX}/{cluster['name']}"
    events = {"mqtt": {"host": "127.0.0.1", "port": mqtt.port, "prefix": prefix}}
    sub = Subscriber(mqtt.port)
    try:
        started += [node(tmp_path, tiny_model, n, cluster, events=events) for n in ("n1", "n2")]
        leader, follower, _ = leader_of(*started)
        lead, follow = leader.policy["cluster"]["node"], follower.policy["cluster"]["node"]
        # events with the node's name, and each node's retained state, on MQTT
        sub.wait(f"{prefix}/events", b"became-leader")
        sub.wait(f"{prefix}/events", b"follower-of")
        sub.wait(f"{prefix}/node/{lead}/state", b'"role":"leader"')
        sub.wait(f"{prefix}/node/{follow}/state", b'"role":"follower"')
        for name in (lead, follow):  # each node's own birth (and Last Will) topic
            sub.wait(f"{prefix}/node/{name}/status", b"online")
    finally:
        sub.close()

    codes = {s.policy["cluster"]["node"]: get(f"{s.api}/primary")[0] for s in started}
    assert sorted(codes.values()) == [200, 503], codes
    lead_view = get(f"{leader.api}/cluster")[1]
    follow_view = get(f"{follower.api}/cluster")[1]
    assert lead_view["role"] == "leader" and follow_view["role"] == "follower"
    assert follow_view["leader"] == lead_view["node"] == leader.policy["cluster"]["node"]
    assert follow_view["leader_router"] == leader.policy["router"]["listen"]
    assert follow_view["cluster_epoch"] == lead_view["epoch"] > 0
    assert {n["node"] for n in follow_view["nodes"]} == {"n1", "n2"}
    primary = get(f"{leader.api}/primary")[1]

    status, headers, body = ask(follower.router)
    assert status == 200, body
    assert headers["X-Holdfast-Node"] == lead_view["node"]
    assert headers["X-Holdfast-Cluster-Epoch"] == str(lead_view["epoch"])
    assert headers["X-Holdfast-Engine"] == body["engine"] == primary["name"]
    # the leader re-promoted its primary into its term: the engine answers in that epoch
    assert int(headers["X-Holdfast-Epoch"]) == body["epoch"] >= term_floor(lead_view["epoch"])

    # a router forwards only once: what another router sent to a follower is refused
    status, headers, _ = ask(follower.router, headers={"X-Holdfast-Forwarded-By": lead})
    assert status == 421 and headers["X-Holdfast-Not-Leader"] == "1"

    out = follower.cli("status", "--cluster", "--json", "--api", follower.policy["api"]["listen"])
    rows = {r["node"]: r for r in json.loads(out.stdout)["nodes"]}
    assert rows[lead_view["node"]]["role"] == "leader"
    assert rows[follow_view["node"]]["role"] == "follower"
    assert rows[lead_view["node"]]["epoch"] == lead_view["epoch"]
    assert all(r["lease_age_s"] is not None for r in rows.values())
    table = follower.cli("status", "--cluster", "--api", follower.policy["api"]["listen"])
    assert f"leader {lead_view['node']}" in table.stdout and "follower" in table.stdout


def test_leader_killed_whole_the_other_node_leads_with_a_larger_epoch(
    tmp_path: Path, tiny_model: Path, etcd: Etcd, started: list[Supervisor]
) -> None:
    cluster = {"name": f"kill-{uuid.uuid4().hex[:6]}", "etcd": [etcd.endpoint]}
    slow = {"retry_deadline_s": DEADLINE}  # a request may wait out the whole failover
    started += [node(tmp_path, tiny_model, n, cluster, router=slow) for n in ("n1", "n2")]
    leader, follower, _ = leader_of(*started)
    status, headers, before = ask(follower.router)
    assert status == 200, before
    old_epoch = int(headers["X-Holdfast-Cluster-Epoch"])

    mark = follower.tap.mark()
    tree = kill_all(leader)
    assert tree, "the leader's supervisor had no children"
    # sent while the dead leader still holds its lease: the forward fails before the
    # first byte, and the router waits for the next leader (this node) and retries
    status, headers, after = ask(follower.router)
    assert status == 200, after
    follower.wait(fleet_event("became-leader"), timeout=DEADLINE, after=mark)
    assert get(f"{follower.api}/primary")[0] == 200
    assert metric(follower.api, "holdfast_supervisor_router_retries_total") >= 1
    assert headers["X-Holdfast-Node"] == follower.policy["cluster"]["node"]
    assert int(headers["X-Holdfast-Cluster-Epoch"]) > old_epoch
    assert int(headers["X-Holdfast-Epoch"]) > int(before["epoch"])
    for pid in tree:  # SIGKILL is delivered, not awaited: wait on each exit itself
        with contextlib.suppress(ProcessLookupError):
            fd = os.pidfd_open(pid)
            try:
                assert select.select([fd], [], [], DEADLINE)[0], f"pid {pid} still runs"
            finally:
                os.close(fd)


def test_single_node_policy_is_unchanged(
    tmp_path: Path, tiny_model: Path, started: list[Supervisor]
) -> None:
    sup = node(tmp_path, tiny_model, "alone", None)
    started.append(sup)
    first = sup.wait_pair(timeout=DEADLINE)
    code, pool = get(f"{sup.api}/cluster")
    assert code == 200 and pool["primary"] == first.name and "cluster" not in pool
    assert get(f"{sup.api}/primary")[0] == 200
    status, headers, body = ask(sup.router)
    assert status == 200 and body["engine"] == first.name
    assert "X-Holdfast-Node" not in headers and "X-Holdfast-Cluster-Epoch" not in headers
    assert headers["X-Holdfast-Epoch"] == str(first.epoch) == "1"
    out = sup.cli("status", "--cluster", "--api", sup.policy["api"]["listen"], check=False)
    assert out.returncode == 1 and "runs no cluster" in out.stderr


def test_unreachable_etcd_is_retried_and_never_serves(
    tmp_path: Path, tiny_model: Path, started: list[Supervisor]
) -> None:
    nowhere = f"127.0.0.1:{free_port()}"
    cluster = {"name": "lonely", "etcd": [nowhere]}
    sup = node(tmp_path, tiny_model, "n1", cluster, router={"retry_deadline_s": 0.5})
    started.append(sup)
    sup.wait_pair(timeout=DEADLINE)
    first = sup.wait(fleet_event("etcd-unreachable"), timeout=DEADLINE)
    assert nowhere in first.data["error"]
    assert get(f"{sup.api}/primary")[0] == 503
    mark = sup.tap.mark()
    sup.wait(fleet_event("etcd-unreachable"), timeout=DEADLINE, after=mark)  # retried
    code, view = get(f"{sup.api}/cluster")
    assert code == 200 and view["role"] == "starting" and view["leader"] is None
    assert get(f"{sup.api}/primary")[0] == 503
    assert ask(sup.router)[0] == 502
    assert "etcd unreachable within" in sup.output() and nowhere in sup.output()


def test_duplicate_node_name_exits_naming_the_first(
    tmp_path: Path, tiny_model: Path, etcd: Etcd, started: list[Supervisor]
) -> None:
    cluster = {"name": f"dup-{uuid.uuid4().hex[:6]}", "etcd": [etcd.endpoint]}
    one = node(tmp_path, tiny_model, "n1", cluster)
    started.append(one)
    one.wait(fleet_event("became-leader"), timeout=DEADLINE)
    (tmp_path / "b").mkdir()
    two = Supervisor(
        write_policy(
            tmp_path / "b" / "policy.yaml",
            tiny_model,
            tmp_path / "b" / "run",
            cluster={"node": "n1", **cluster},
        )
    )
    started.append(two)
    assert two.proc.wait(DEADLINE) != 0
    out = two.output()
    assert f"node name 'n1' is held by a live supervisor (pid {one.proc.pid}" in out, out
    assert not running_in(two.run)
    assert get(f"{one.api}/primary")[0] == 200  # the first is untouched


def test_a_leader_that_loses_its_term_cuts_the_request_under_way(
    tmp_path: Path, tiny_model: Path, started: list[Supervisor]
) -> None:
    (tmp_path / "etcd").mkdir()
    frozen = Etcd(tmp_path / "etcd")  # its own: this test freezes it
    try:
        cluster = {"name": "cut", "etcd": [frozen.endpoint]}
        sup = node(tmp_path, tiny_model, "n1", cluster, router={"retry_deadline_s": 2.0})
        started.append(sup)
        won = sup.wait(fleet_event("became-leader"), timeout=DEADLINE)
        answers: list[tuple[int, dict[str, str], dict[str, Any]]] = []
        client = threading.Thread(target=lambda: answers.append(ask(sup.router, sleep_s=600)))
        client.start()
        until(lambda: any(e["in_flight"] for e in get(f"{sup.api}/cluster")[1]["engines"]))
        mark = sup.tap.mark()
        frozen.stop()  # no renewal succeeds: the term ends at its hold deadline
        client.join(DEADLINE)
        status, _, body = answers[0]
        # cut before its first byte (the engine would sleep 600 s), then no leader to retry on
        assert status == 502 and "NotLeader" in body["error"], body
        down = sup.wait(fleet_event("stepped-down"), timeout=DEADLINE, after=mark)
        assert down.data["reason"] == "renewal_stale"
        assert get(f"{sup.api}/primary")[0] == 503
        # frozen past the lease's TTL as the node counts it: the session is given up
        sup.wait(fleet_event("lease-lost"), timeout=DEADLINE, after=mark)
        frozen.cont()
        # it leads again: in a new term; or in the lapsed one, resumed on its kept lease,
        # when etcd came back before its own clock ran that lease out (the node counts the
        # TTL from a renewal's send, etcd from its arrival; no other node could have won)
        again = sup.wait(
            lambda ev: fleet_event("became-leader")(ev) or fleet_event("resumed-leader")(ev),
            timeout=DEADLINE,
            after=mark,
        )
        if again.event == "became-leader":
            assert again.epoch > won.epoch
        else:
            assert again.epoch == won.epoch  # the same term
        until(lambda: get(f"{sup.api}/primary")[0] == 200)
    finally:
        frozen.kill()


def until(ok: Callable[[], bool]) -> None:
    """Poll a condition on a health API (nothing to wait on): a generous deadline."""
    deadline = time.monotonic() + DEADLINE
    while not ok():
        assert time.monotonic() < deadline, "condition not met"
        time.sleep(0.05)


def test_another_model_in_the_same_cluster_exits_naming_both(
    tmp_path: Path, tiny_model: Path, etcd: Etcd, started: list[Supervisor]
) -> None:
    cluster = {"name": f"model-{uuid.uuid4().hex[:6]}", "etcd": [etcd.endpoint]}
    one = node(tmp_path, tiny_model, "n1", cluster)
    started.append(one)
    one.wait(fleet_event("became-leader"), timeout=DEADLINE)
    # the same checkpoint served as bfloat16: another cache fingerprint
    two = node(tmp_path, tiny_model, "n2", cluster, model={"dtype": "bfloat16"})
    started.append(two)
    assert two.proc.wait(DEADLINE) != 0
    out = two.output()
    assert f"cluster {cluster['name']!r} serves model fingerprint" in out, out
    assert "first set by node 'n1'" in out and "node 'n2' has" in out
    assert not running_in(two.run)
