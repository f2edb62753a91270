"""Engines as tp groups (one process per rank, one_for_all) checked by HTTP health only:
two cache daemons, echo engines without the agent SDK."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

from holdfast_contract.env import var
from supervisor.exitwatch import is_exiting
from tests.engines.harness import (
    ECHO,
    Supervisor,
    complete,
    exits_within,
    get,
    pid_alive,
    write_policy,
)


def rank_pid(name: str, rank: int) -> int:
    """The pid of engine `name`'s rank `rank`, found by its HOLDFAST_* environment."""
    want = {f"{var('name')}={name}".encode(), f"{var('rank')}={rank}".encode()}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = set(f.read().split(b"\0"))
        except OSError:
            continue
        if want <= env and var("agent").encode() not in b"".join(env) and pid_alive(int(entry)):
            return int(entry)
    raise AssertionError(f"no rank {rank} process for {name}")


def test_tp2_group_dies_together_and_http_health_finds_hangs(
    tmp_path: Path, tiny_model: Path
) -> None:
    policy = write_policy(
        tmp_path / "policy.yaml",
        tiny_model,
        tmp_path / "run",
        model={"tp_size": 2},
        devices={"ids": ["cpu", "cpu"]},
        engines={"command": [*ECHO, "--no-agent"], "health": "http"},
        heartbeat={"interval_ms": 100, "miss_limit": 5},
    )
    sup = Supervisor(policy)
    try:
        first = sup.wait(lambda e: e.event == "promoted", timeout=180)
        sup.wait(lambda e: e.event == "ready" and e.name != first.name, timeout=60)
        assert {d["rank"] for d in sup.status()["daemons"]} == {0, 1}
        assert complete(sup.router)[0] == 200

        leader = get(f"{sup.api}/primary")[1]["pid"]
        mark = sup.tap.mark()
        # one rank dies: the group is dead. While the supervisor is frozen, so that when it
        # runs again both its reaper and its exit watch have the exit to see, in either
        # order: rank 0, which it then kills itself, is never the one named
        os.kill(sup.proc.pid, signal.SIGSTOP)
        try:
            follower = rank_pid(first.name, 1)
            os.kill(follower, signal.SIGKILL)
            assert exits_within(follower, 30)
        finally:
            os.kill(sup.proc.pid, signal.SIGCONT)
        died = sup.wait(lambda e: e.topic == f"engine.{first.name}.died", timeout=10, after=mark)
        # seen exiting by the exit watch (with how, unless reaped before its look), or its
        # exit waited for: either names the rank
        detail = died.data["detail"]
        assert re.fullmatch(r"rank 1 (exited with -9|is exiting( \(killed by signal 9\))?)", detail)
        second = sup.wait(lambda e: e.event == "promoted", timeout=10, after=mark)
        # promoted once the group runs no more code: rank 0 is gone, or killed and exiting
        assert second.name != first.name and (not pid_alive(leader) or is_exiting(leader))
        sup.wait(lambda e: e.topic == f"engine.{first.name}.ready", timeout=60, after=mark)

        mark = sup.tap.mark()
        os.kill(get(f"{sup.api}/primary")[1]["pid"], signal.SIGSTOP)  # no agent: HTTP health
        hung = sup.wait(lambda e: e.topic == f"engine.{second.name}.died", timeout=10, after=mark)
        assert hung.data["cause"] == "hang"
        sup.wait(lambda e: e.event == "promoted", timeout=10, after=mark)
        assert complete(sup.router)[0] == 200
        assert sup.cli("stop").stdout.strip() == "stopping"
        assert sup.proc.wait(30) == 0, sup.output()
        sup.tap.close()
    finally:
        if sup.proc.poll() is None:
            sup.stop(signal.SIGKILL)
