"""The fleet never sends a packet outside its namespaces: while a fleet is up the host holds
an `unreachable` route for its subnet, so a host-side connect to a fleet address fails at
once; `down` removes it. Two fleets with their own prefix and subnet are up at once.

Every connect to a fleet address from the host comes after the route is seen in place."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest

from chaos.fleet.net import Fleet, in_ns, missing

pytestmark = pytest.mark.skipif(missing() is not None, reason=str(missing()))

UNREACHABLE = (errno.EHOSTUNREACH, errno.ENETUNREACH)


def unreachable_routes() -> set[str]:
    out = subprocess.run(
        ["ip", "-j", "route", "show", "type", "unreachable"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {r["dst"] for r in json.loads(out or "[]")}


def routed(subnet: str) -> bool:
    """Whether the host routes anything inside subnet.0/24 (then it is not ours to use)."""
    out = subprocess.run(
        ["ip", "route", "show", "root", f"{subnet}.0/24"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return bool(out.strip())


def free_subnet(first: int) -> str:
    for third in range(first, 256):
        subnet = f"10.231.{third}"
        if not routed(subnet):
            return subnet
    raise AssertionError("no free 10.231.x.0/24 for a test fleet")


def names(kind: str) -> set[str]:
    if kind == "netns":
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        return {line.split()[0] for line in out.splitlines() if line.strip()}
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return {line.split(": ")[1].split("@")[0] for line in out.splitlines()}


def host_connect(addr: str, port: int) -> int:
    """The errno of a connect from the host's namespace (0 when it connected)."""
    with socket.socket() as s:
        s.settimeout(30)  # only a packet that left would wait: a route error is at once
        return s.connect_ex((addr, port))


@pytest.fixture
def fleets(tmp_path: Path) -> Iterator[list[Fleet]]:
    tag = os.getpid() % 1000
    a_net = free_subnet(tag % 200)
    b_net = free_subnet(int(a_net.rsplit(".", 1)[1]) + 1)
    made = [
        Fleet(tmp_path / "a", prefix=f"ta{tag}", subnet=a_net),
        Fleet(tmp_path / "b", prefix=f"tb{tag}", subnet=b_net),
    ]
    try:
        yield made
    finally:
        for f in made:
            f.down()


def test_a_host_side_connect_to_a_fleet_address_fails_at_once(fleets: list[Fleet]) -> None:
    a, b = fleets
    before = names("netns") | names("link")
    a.up(1)
    b.up(1)  # a second fleet beside the first: nothing of theirs collides
    routes = unreachable_routes()
    assert {f"{a.subnet}.0/24", f"{b.subnet}.0/24"} <= routes  # before any connect below
    for f in fleets:
        assert {f"{f.prefix}-n1", f"{f.prefix}-e1", f.client_ns} <= names("netns")
        assert {f.bridge, f"{f.prefix}v-n1"} <= names("link")
        etcd_host, etcd_port = f.endpoints[0].split(":")
        node = Fleet.address("n1", f.prefix, f.subnet)
        assert host_connect(node, 8000) in UNREACHABLE
        assert host_connect(etcd_host, int(etcd_port)) in UNREACHABLE
        # inside the fleet the same address answers: the route is the host's alone
        assert in_ns(f.client_ns, partial(host_connect, etcd_host, int(etcd_port))) == 0
    a.down()
    assert f"{a.subnet}.0/24" not in unreachable_routes()
    assert f"{b.subnet}.0/24" in unreachable_routes()  # the other fleet still held
    left = (names("netns") | names("link")) - before
    assert left and all(n.startswith(b.prefix) for n in left), left
    b.down()
    assert not {f"{a.subnet}.0/24", f"{b.subnet}.0/24"} & unreachable_routes()
    assert (names("netns") | names("link")) - before == set()
