"""A promoted primary computes first: the supervisor lowers the nice value of each of its
threads to `engines.primary_nice`, and leaves every other engine's alone (0: nobody's).
Real `supervisor run` and engines on the tiny checkpoint; needs root (CAP_SYS_NICE)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.engines.harness import get
from tests.supervisor.proxy.test_router_streams import ENGINE, boot

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="lowering a nice value needs root")


def nices(pid: int) -> set[int]:
    """The nice value of every thread of `pid` (field 19 of /proc/PID/task/TID/stat)."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            out.add(int(f.read().rpartition(")")[2].split()[16]))
    return out


@pytest.mark.parametrize("nice", [-5, 0])
def test_the_promoted_primary_alone_runs_at_primary_nice(
    tmp_path: Path, tiny_model: Path, nice: int
) -> None:
    sup = boot(
        tmp_path,
        tiny_model,
        engines={"command": ENGINE, "ready_timeout_s": 120, "primary_nice": nice},
    )
    try:
        first = sup.wait_pair()
        primary = get(f"{sup.api}/primary")[1]
        standby = get(f"{sup.api}/standby")[1][0]
        assert nices(primary["pid"]) == {nice}
        assert nices(standby["pid"]) == {0}
        mark = sup.tap.mark()
        os.kill(primary["pid"], signal.SIGKILL)
        promoted = sup.wait(lambda e: e.event == "promoted", timeout=10, after=mark)
        assert promoted.name == standby["name"] != first.name
        assert nices(standby["pid"]) == {nice}
        replacement = sup.wait(lambda e: e.event == "ready", timeout=60, after=mark)
        assert nices(get(f"{sup.api}/standby")[1][0]["pid"]) == {0}, replacement
        assert sup.stop(signal.SIGTERM) == 0, sup.output()
    finally:
        if sup.proc.poll() is None:
            sup.stop(signal.SIGKILL)
