"""`update.park`: the supervisor keeps a cache daemon per rank started ahead (imported,
its device's context made), and the next update's pool is loaded by it: the new
generation's daemon is the process that was parked, its output goes to the generation's
log, another is parked in its place, and none outlives the supervisor."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

from tests.engines.harness import exits_within, topic
from tests.supervisor.update.test_update_rollout import boot


def parked_pids(log: Path) -> list[int]:
    """The pids of the daemons parked so far, from the parked daemons' log."""
    if not log.exists():
        return []
    lines = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
    return [x["pid"] for x in lines if x.get("event") == "parked"]


def until_parked(log: Path, count: int, timeout: float = 120) -> list[int]:
    deadline = time.monotonic() + timeout
    while len(pids := parked_pids(log)) < count:
        assert time.monotonic() < deadline, f"{count} parked daemons not seen in {log}"
        time.sleep(0.05)
    return pids


def test_an_update_is_loaded_by_the_daemon_parked_for_it(
    tmp_path: Path, tiny_model: Path, next_model: Path
) -> None:
    sup = boot(tmp_path, tiny_model, update={"keep_old_s": 0.5, "park": True})
    try:
        sup.wait_pair()
        parked_log = sup.run / "logs" / "daemon-0-parked.log"
        (first,) = until_parked(parked_log, 1)
        mark = sup.tap.mark()
        sup.cli("update", "--model", str(next_model))
        sup.wait(topic("update.main.finished"), timeout=300, after=mark)
        (daemon,) = sup.status()["daemons"]
        assert daemon["pid"] == first
        gen_log = (sup.run / "gen-2" / "logs" / "daemon-0.log").read_text()
        claimed = [json.loads(x) for x in gen_log.splitlines() if '"claimed"' in x]
        assert claimed and claimed[0]["pid"] == first, gen_log[-2000:]
        assert "pool ready" in gen_log
        _, second = until_parked(parked_log, 2)
        assert second != first
        assert sup.stop(signal.SIGTERM) == 0, sup.output()
        assert exits_within(second, 10) and exits_within(first, 10)
    finally:
        if sup.proc.poll() is None:
            sup.stop(signal.SIGKILL)
