"""A stream through a follower's router survives the loss of the leader's whole node: the
follower takes the lease over and its router continues the cut stream on its own primary
by token replay, so the client reads one stream equal to the same request without the
fault. With no node able to take over within `router.retry_deadline_s`, the stream ends
with an error event in OpenAI's shape and no `[DONE]`.

Real `supervisor run` nodes on loopback (a real cache daemon and one reference engine,
`python -m engine` on the tiny checkpoint, each) electing through a real etcd. The answer
is sized in tokens: long enough that a fault after CUT_AFTER events lands mid-stream."""

from __future__ import annotations

import http.client
import json
import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.fleet.node import term_floor
from tests.engines.harness import Supervisor, get, topic, write_policy
from tests.fleet_etcd import Etcd
from tests.supervisor.fleet.test_fleet_node import descendants, fleet_event, kill_all, leader_of
from tests.supervisor.proxy.test_router_streams import (
    CUT_AFTER,
    ENGINE,
    PROMPT,
    TOKENS,
    chunks,
    migrations,
)
from tests.supervisor.proxy.test_router_streams import token_ids as ids_of

DEADLINE = 90.0  # generous: two shared cores
TTL_S = 2  # the leader lease: a silent leader's key is freed within its 1.5 s hold
# covers the lease (the follower waits out TTL_S at worst, then campaigns) with room for
# a loaded machine; it bounds how long a cut stream waits, it is not what is measured
RETRY_DEADLINE_S = 5 * TTL_S


class Lost:
    """A node lost: its supervisor stopped (SIGTERM), or it and every process under it
    killed or frozen as one."""

    def __init__(self, sup: Supervisor, how: str) -> None:
        self.sup, self.how = sup, how
        if how == "stop":  # `supervisor stop`: it leaves the cluster, then stops its engines
            sup.proc.send_signal(signal.SIGTERM)
            return
        if how == "kill":
            kill_all(sup)  # frozen first, so no process is added meanwhile
            return
        os.kill(sup.proc.pid, signal.SIGSTOP)
        self.tree = descendants(sup.proc.pid)
        for pid in self.tree:
            os.kill(pid, signal.SIGSTOP)

    def reap(self) -> None:
        if self.how == "freeze" and self.sup.proc.poll() is None:
            for pid in [self.sup.proc.pid, *self.tree]:
                os.kill(pid, signal.SIGKILL)
            self.sup.proc.wait(30)


@pytest.fixture
def started() -> Iterator[list[Supervisor]]:
    sups: list[Supervisor] = []
    try:
        yield sups
    finally:
        for s in sups:
            s.stop()


def fleet_node(base: Path, model: Path, name: str, cluster: dict[str, Any]) -> Supervisor:
    """One node: a single engine (the follower's is the cluster's warm standby)."""
    d = base / name
    d.mkdir()
    policy = write_policy(
        d / "policy.yaml",
        model,
        d / "run",
        engines={"command": ENGINE, "standby": 0, "ready_timeout_s": 120, "stop_grace_s": 5.0},
        heartbeat={"interval_ms": 100, "miss_limit": 10},
        router={"retry_deadline_s": RETRY_DEADLINE_S},
        cluster={"node": name, "ttl_s": TTL_S, **cluster},
    )
    return Supervisor(policy)


def two_nodes(
    base: Path, model: Path, etcd: Etcd, started: list[Supervisor]
) -> tuple[Supervisor, Supervisor]:
    """(leader, follower), once both see the leader and the follower's primary serves."""
    cluster = {"name": f"stream-{uuid.uuid4().hex[:6]}", "etcd": [etcd.endpoint]}
    pair = [fleet_node(base, model, n, cluster) for n in ("n1", "n2")]
    started += pair
    leader, follower, _ = leader_of(*pair)
    follower.wait(lambda e: e.event == "promoted", timeout=DEADLINE)  # it can campaign
    return leader, follower


def open_stream(router: str) -> tuple[dict[str, str], Iterator[bytes]]:
    """The response headers of one streamed completion of TOKENS greedy tokens, and the
    data of each of its server-sent events as it arrives."""
    host, port = router.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=DEADLINE)
    body = {"prompt_token_ids": PROMPT, "max_tokens": TOKENS, "stream": True}
    body |= {"ignore_eos": True, "temperature": 0}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()

    def events() -> Iterator[bytes]:
        try:
            buf = b""
            while chunk := resp.read1(65536):
                buf += chunk
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    yield event.removeprefix(b"data: ")
        finally:
            conn.close()

    return dict(resp.headers), events()


def cut_by(sup: Supervisor, how: str, router: str) -> tuple[dict[str, str], list[bytes], Lost]:
    """A stream through `router` whose node `sup` is lost (`how`) after CUT_AFTER events."""
    headers, stream = open_stream(router)
    events: list[bytes] = []
    lost: Lost | None = None
    for data in stream:
        events.append(data)
        if len(events) == CUT_AFTER:
            lost = Lost(sup, how)
    assert lost is not None, f"the stream ended after {len(events)} events, before the fault"
    return headers, events, lost


def finish_reasons(events: list[bytes]) -> list[str]:
    return [
        c["finish_reason"]
        for chunk in chunks(events)
        for c in chunk.get("choices", [])
        if c.get("finish_reason") is not None
    ]


@pytest.mark.parametrize("how", ["kill", "freeze", "stop"])
def test_a_stream_through_a_follower_goes_on_on_its_primary_when_the_leader_node_is_lost(
    tmp_path: Path, tiny_model: Path, etcd: Etcd, started: list[Supervisor], how: str
) -> None:
    """Three ways a node is lost, each cut reaching the follower by another path:

    - `kill`: the node crashes (SIGKILL of its supervisor and every process under it):
      the kernel closes its sockets, so the follower sees the cut at once and waits only
      for the lease.
    - `freeze`: the node goes silent (SIGSTOP of the same processes), as a machine that
      loses power or its network does: nothing closes the forwarded connection, and only
      the follower's view of the lease (the leader key freed at the leader's deadline)
      cuts it. This is the loss that only etcd can reveal.
    - `stop`: the node is stopped (SIGTERM, a planned restart): the leader steps down,
      which cuts its primary's streams, hands the forwarded one back to the follower and
      revokes its lease.

    Each time the continuation runs on the follower's own primary once it leads, within
    router.retry_deadline_s (which covers the lease).

    The fault comes once the client has read CUT_AFTER events; where the client reads
    late (a busy machine), the engine may have sent the whole stream by then, and nothing
    is left to cut: such a trial is run again on new nodes (a stream that ends whole with
    no `: migrated` in it was never cut: one that was cut always says so)."""
    for attempt in range(3):
        base = tmp_path / f"trial-{attempt}"
        base.mkdir()
        leader, follower = two_nodes(base, tiny_model, etcd, started)
        lead = leader.policy["cluster"]["node"]
        here = follower.policy["cluster"]["node"]
        headers, reference_stream = open_stream(follower.router)
        reference = list(reference_stream)
        assert reference[-1] == b"[DONE]" and len(ids_of(reference)) == TOKENS
        assert headers["X-Holdfast-Node"] == lead  # forwarded to the leader's primary
        old_term = int(headers["X-Holdfast-Cluster-Epoch"])

        mark = follower.tap.mark()
        headers, events, lost = cut_by(leader, how, follower.router)
        if b": migrated" in events or events[-1] != b"[DONE]":
            break
        lost.reap()  # the whole stream came before the fault: again, on new nodes
    try:
        assert headers["X-Holdfast-Node"] == lead
        won = follower.wait(fleet_event("became-leader"), timeout=DEADLINE, after=mark)
        assert won.epoch > old_term
        resumed = follower.wait(topic(f"router.{here}.migrated"), timeout=DEADLINE, after=mark)
        # the continuation ran on this node's primary, in the new term
        assert resumed.epoch >= term_floor(won.epoch)
        assert 0 < resumed.data["tokens"] < TOKENS
        # one stream: every token once, the same ones as without the fault, a finish, [DONE]
        assert events[-1] == b"[DONE]", events[-3:]
        assert ids_of(events) == ids_of(reference)
        assert finish_reasons(events) == ["length"]
        assert len({chunk["id"] for chunk in chunks(events)}) == 1
        assert events.count(b": migrated") == 1
        where = events.index(b": migrated")  # the tokens before it came through the leader
        assert where >= CUT_AFTER and len(ids_of(events[:where])) == resumed.data["tokens"]
        counts = migrations(follower)
        assert (counts["attempted"], counts["succeeded"], counts["failed"]) == (1, 1, 0)
        assert counts["stalls"] == 1
        assert get(f"{follower.api}/primary")[0] == 200
    finally:
        lost.reap()


def test_a_stream_cut_with_no_node_to_take_over_ends_with_an_error(
    tmp_path: Path, tiny_model: Path, etcd: Etcd, started: list[Supervisor]
) -> None:
    """etcd frozen, then the leader's node killed: no node can be elected, so the
    follower's router waits out router.retry_deadline_s and ends the stream with an error
    event, never `[DONE]`."""
    leader, follower = two_nodes(tmp_path, tiny_model, etcd, started)
    headers, stream = open_stream(follower.router)
    assert headers["X-Holdfast-Node"] == leader.policy["cluster"]["node"]
    events: list[bytes] = []
    try:
        for data in stream:
            events.append(data)
            if len(events) == CUT_AFTER:
                etcd.stop()  # no campaign can succeed from here on
                kill_all(leader)
        assert len(events) > CUT_AFTER, "the stream ended before the fault"
        assert b"[DONE]" not in events
        last = json.loads(events[-1])
        assert set(last) == {"error"} and last["error"]["type"] == "upstream_error"
        assert f"router.retry_deadline_s ({RETRY_DEADLINE_S:g} s)" in last["error"]["message"]
        assert 0 < len(ids_of(events)) < TOKENS
        assert b": migrated" not in events
        counts = migrations(follower)
        assert (counts["attempted"], counts["succeeded"], counts["failed"]) == (1, 0, 1)
        assert get(f"{follower.api}/primary")[0] == 503  # nobody took over
    finally:
        etcd.cont()
