"""The fleet's network: scripts/fleet.sh (namespaces, bridge, 3-member etcd) and threads that
work inside one namespace.

The host has no address on the fleet's bridge, and holds an `unreachable` route for the
fleet's subnet while it is up (a connect from the host fails at once with EHOSTUNREACH), so
whatever talks to a node's router or health API runs in a thread that has entered a
namespace first (setns(2) moves only the
calling thread, and threads it starts inherit it). Every time here is CLOCK_MONOTONIC,
which every namespace of the machine shares.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

REPO = Path(__file__).resolve().parents[2]
FLEET_SH = REPO / "scripts" / "fleet.sh"
DEFAULT_PREFIX = "hf"  # fleet.sh's default HF_FLEET_PREFIX
DEFAULT_SUBNET = "10.77.0"  # ... and HF_FLEET_SUBNET
CLIENT_NS = "hf-c1"  # fleet.sh's client namespace with the default prefix, 10.77.0.100
CLONE_NEWNET = 0x40000000
GONE_TIMEOUT_S = 30.0
T = TypeVar("T")


class FleetError(Exception):
    """The fleet could not be built or driven; the message says what to do."""


def missing() -> str | None:
    """Why a fleet cannot be built here, or None."""
    if os.geteuid() != 0:
        return "needs root to build network namespaces (run as root)"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` (apt-get install -y iproute2)"
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "`ip netns` does not work here (no network namespace support)"
    if shutil.which("etcd") is None:
        return "needs etcd (apt-get install -y etcd-server)"
    return None


def ns_of(node: str) -> str:
    return node if node.startswith("hf-") else f"hf-{node}"


def enter(ns: str) -> None:
    """Move the calling thread into network namespace `ns` (made by fleet.sh)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise FleetError(f"setns into {ns} failed: {os.strerror(err)}")
    finally:
        os.close(fd)


def in_ns(ns: str, fn: Callable[[], T]) -> T:
    """fn() run in a thread inside `ns`; its result or its exception."""
    box: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            enter(ns)
            box.append(fn())
        except BaseException as exc:  # handed to the caller
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return box[0]


def ns_pids(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_gone(pids: list[int], timeout: float = GONE_TIMEOUT_S) -> list[int]:
    """The pids still alive after `timeout` (reaped or zombie counts as gone)."""
    deadline = time.monotonic() + timeout
    left = [p for p in pids if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.01)  # another parent's processes: no event to wait on
        left = [p for p in left if alive(p)]
    return left


def signal_ns(ns: str, sig: signal.Signals) -> list[int]:
    """Send `sig` to every process in namespace `ns`; the pids signalled."""
    pids = ns_pids(ns)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    return pids


class Fleet:
    """`scripts/fleet.sh` with its own state dir, etcd flags, name prefix and subnet (two
    fleets with different prefixes and subnets can be up at once)."""

    def __init__(
        self,
        state: Path,
        etcd_flags: str = "",
        prefix: str = DEFAULT_PREFIX,
        subnet: str = DEFAULT_SUBNET,
    ) -> None:
        self.state = state
        self.prefix = prefix
        self.subnet = subnet
        self.bridge = f"{prefix}-br0"
        self.client_ns = f"{prefix}-c1"
        self.env = {
            **os.environ,
            "HF_FLEET_STATE": str(state),
            "HF_FLEET_ETCD_FLAGS": etcd_flags,
            "HF_FLEET_PREFIX": prefix,
            "HF_FLEET_SUBNET": subnet,
        }
        self.nodes: list[str] = []
        self.endpoints: list[str] = []

    def sh(self, *args: str, check: bool = True) -> str:
        done = subprocess.run(
            ["bash", str(FLEET_SH), *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        if check and done.returncode != 0:
            raise FleetError(f"fleet.sh {' '.join(args)} failed: {done.stderr.strip()}")
        return done.stdout

    def up(self, n: int) -> None:
        if subprocess.run(["ip", "link", "show", self.bridge], capture_output=True).returncode == 0:
            raise FleetError(
                f"a fleet is up already ({self.bridge} exists); run "
                f"`HF_FLEET_PREFIX={self.prefix} scripts/fleet.sh down`"
            )
        out = self.sh("up", str(n))
        self.endpoints = out.strip().splitlines()[-1].removeprefix("HF_FLEET_ETCD=").split(",")
        self.nodes = [f"n{i}" for i in range(1, n + 1)]

    def down(self) -> None:
        self.sh("down", check=False)

    def isolate(self, node: str) -> None:
        self.sh("isolate", node)

    def rejoin(self, node: str) -> None:
        self.sh("rejoin", node)

    def stop_member(self, *index: int) -> None:
        self.sh("stop-member", *map(str, index))

    def start_member(self, *index: int) -> None:
        self.sh("start-member", *map(str, index))

    def member_pid(self, index: int) -> int:
        return int((self.state / f"e{index}" / "pid").read_text())

    def etcd_leader(self) -> int | None:
        """The member (1-3) that leads etcd's raft now, asked of each member's status from
        the client namespace; None when no member answers."""

        def ask() -> int | None:
            for i, endpoint in enumerate(self.endpoints, 1):
                req = urllib.request.Request(f"http://{endpoint}/v3/maintenance/status", b"{}")
                try:
                    with urllib.request.urlopen(req, timeout=1.0) as r:
                        status = json.loads(r.read())
                except (OSError, ValueError):
                    continue
                if status.get("leader") == status.get("header", {}).get("member_id"):
                    return i
            return None

        return in_ns(self.client_ns, ask)

    def ns(self, node: str) -> str:
        """The namespace of `node` (n2 or <prefix>-n2)."""
        return node if node.startswith(f"{self.prefix}-") else f"{self.prefix}-{node}"

    @staticmethod
    def address(node: str, prefix: str = DEFAULT_PREFIX, subnet: str = DEFAULT_SUBNET) -> str:
        """Node `node`'s address (n2 or <prefix>-n2 -> <subnet>.2)."""
        return f"{subnet}.{int(node.removeprefix(f'{prefix}-').removeprefix('n'))}"
