"""A leader whose supervisor is paused (SIGSTOP past the lease's TTL, then SIGCONT) while
requests are inside its engine: the engine answers them after the term has ended and a
new leader serves, and none of those answers may reach a client under the old term. The
woken node then forwards to the new leader, within a second of waking.

Real `supervisor run` nodes on loopback (a real cache daemon and an echo engine each)
electing through a real etcd. The echo engine holds each request until told
(`"hold": true`, `POST /release`), so the answers are made when the test says: after
the new leader won, while the old leader's supervisor is stopped. Nothing is timed but
the woken node's first forwarded answer."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.engines.harness import Supervisor, get, write_policy
from tests.fleet_etcd import Etcd
from tests.supervisor.fleet.test_fleet_node import fleet_event, leader_of, until

DEADLINE = 90.0  # generous: two shared cores
TTL_S = 2
HELD = 3  # requests of each kind (plain, streamed) inside the leader's engine at the pause
WOKEN_ANSWERS_WITHIN_S = 1.0  # the woken node forwards within this long of SIGCONT


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Etcd]:
    server = Etcd(tmp_path_factory.mktemp("etcd"))
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def started() -> Iterator[list[Supervisor]]:
    sups: list[Supervisor] = []
    try:
        yield sups
    finally:
        for s in sups:
            with_cont(s)
            s.stop()


def with_cont(sup: Supervisor) -> None:
    """A supervisor left stopped by a failed test is resumed, so that it can stop."""
    if sup.proc.poll() is None:
        os.kill(sup.proc.pid, signal.SIGCONT)


def pause_node(base: Path, model: Path, name: str, cluster: dict[str, Any]) -> Supervisor:
    d = base / name
    d.mkdir()
    policy = write_policy(
        d / "policy.yaml",
        model,
        d / "run",
        engines={"standby": 0, "stop_grace_s": 1.0},
        heartbeat={"interval_ms": 100, "miss_limit": 10},
        router={"retry_deadline_s": 10 * TTL_S},
        cluster={"node": name, "ttl_s": TTL_S, **cluster},
    )
    return Supervisor(policy)


@dataclass
class Outcome:
    """What one client saw: the status and headers, if any came, and the body's bytes."""

    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    error: str = ""
    ended: float = 0.0  # monotonic clock when the answer or its cut came


def send(router: str, out: Outcome, **extra: Any) -> None:
    """One completion through `router`, read to its end or its cut, into `out`."""
    host, port = router.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=DEADLINE)
    try:
        body = json.dumps({"prompt": "held", **extra})
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        out.status, out.headers = resp.status, dict(resp.headers)
        while chunk := resp.read1(65536):
            out.body += chunk
        if resp.chunked and not resp.isclosed():
            out.error = "no end of the chunked body"
    except (OSError, http.client.HTTPException) as e:
        out.error = repr(e)
    finally:
        out.ended = time.monotonic()
        conn.close()


def engine_port(sup: Supervisor) -> int:
    engines = get(f"{sup.api}/cluster")[1]["engines"]
    (primary,) = [e for e in engines if e["state"] == "primary"]
    return int(primary["port"])


def release(port: int) -> int:
    """Held requests of the engine on `port` answer now; how many it still has in flight."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/release", data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=10) as r:
        in_flight: int = json.loads(r.read())["in_flight"]
        return in_flight


def queued(router: str) -> int:
    """Connections to `router`'s port that its kernel accepted and nobody took yet."""
    port = int(router.rsplit(":", 1)[1])
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state, queues = line.split()[1], line.split()[3], line.split()[4]
        if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # listening
            return int(queues.split(":")[1], 16)  # its accept queue
    return 0


def in_flight(sup: Supervisor) -> int:
    return sum(e["in_flight"] for e in get(f"{sup.api}/cluster")[1]["engines"])


def test_a_paused_leader_releases_no_answer_of_its_ended_term_and_forwards_once_awake(
    tmp_path: Path, tiny_model: Path, etcd: Etcd, started: list[Supervisor]
) -> None:
    cluster = {"name": f"pause-{uuid.uuid4().hex[:6]}", "etcd": [etcd.endpoint]}
    started += [pause_node(tmp_path, tiny_model, n, cluster) for n in ("n1", "n2")]
    leader, follower, _ = leader_of(*started)
    follower.wait(lambda e: e.event == "promoted", timeout=DEADLINE)  # it can campaign
    lead, follow = (s.policy["cluster"]["node"] for s in (leader, follower))
    old_term = get(f"{leader.api}/cluster")[1]["epoch"]
    ports = engine_port(leader), engine_port(follower)

    outcomes = [Outcome() for _ in range(2 * HELD)]
    clients = [
        threading.Thread(target=send, args=(leader.router, out), kwargs={"hold": True, **kind})
        for out, kind in zip(outcomes, [{}, {"stream": True}] * HELD, strict=True)
    ]
    for c in clients:
        c.start()
    until(lambda: in_flight(leader) == 2 * HELD)  # all inside the leader's engine

    mark = follower.tap.mark()
    os.kill(leader.proc.pid, signal.SIGSTOP)  # the supervisor only: its engine goes on
    try:
        won = follower.wait(fleet_event("became-leader"), timeout=DEADLINE, after=mark)
        assert won.epoch > old_term
        # the answers are made now: after the old term ended and a new leader won
        release(ports[1])
        deadline = time.monotonic() + DEADLINE
        while release(ports[0]):
            assert time.monotonic() < deadline, "the held requests were not answered"
            time.sleep(0.01)  # the engine's handlers finishing: no event to wait on
        # requests that reach the stopped node: its kernel queues them until it wakes
        early = [Outcome() for _ in range(HELD)]
        waiting = [threading.Thread(target=send, args=(leader.router, o)) for o in early]
        for c in waiting:
            c.start()
        until(lambda: queued(leader.router) >= len(early))
    finally:
        os.kill(leader.proc.pid, signal.SIGCONT)
    woke = time.monotonic()
    probe = Outcome()
    send(leader.router, probe)
    for c in clients + waiting:
        c.join(DEADLINE)

    stale = [o for o in outcomes if o.headers.get("X-Holdfast-Cluster-Epoch") == str(old_term)]
    assert not stale, f"answers released under the ended term {old_term}: {stale}"
    for out in outcomes:  # retried on the new leader before any byte, or cut
        assert out.error or (
            out.status == 200
            and out.headers["X-Holdfast-Node"] == follow
            and out.headers["X-Holdfast-Cluster-Epoch"] == str(won.epoch)
        ), out
    # the woken node follows the new leader at once: it forwards, it does not fail
    for out in [*early, probe]:
        assert out.status == 200 and not out.error, out
        assert out.headers["X-Holdfast-Node"] == follow != lead
        assert out.headers["X-Holdfast-Cluster-Epoch"] == str(won.epoch)
        took = out.ended - woke
        assert took < WOKEN_ANSWERS_WITHIN_S, f"the woken node answered {took:.2f} s after waking"
