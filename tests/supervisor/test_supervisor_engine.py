"""The reference engine (`python -m engine`) under the supervisor: it attaches to the daemon,
is promoted, answers through the router, and a kill -9 of it fails over with no lost request.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from engine.server import ENDED_EARLY
from tests.engine.test_engine_serve import leave_a_request
from tests.engines.harness import Load, Supervisor, complete, write_policy


def test_reference_engine_fails_over_under_load(tmp_path: Path, tiny_model: Path) -> None:
    policy = write_policy(
        tmp_path / "policy.yaml",
        tiny_model,
        tmp_path / "run",
        engines={"command": ["{python}", "-m", "engine"], "ready_timeout_s": 120},
        heartbeat={"interval_ms": 100, "miss_limit": 10},
    )
    sup = Supervisor(policy)
    try:
        first = sup.wait_pair()
        code, body = complete(sup.router, None, prompt_token_ids=[1, 2, 3], max_tokens=4)
        assert code == 200, body
        load = Load(sup.router, clients=2, prompt=None, prompt_token_ids=[1, 2], max_tokens=2)
        try:
            load.wait_ok(5, timeout=60)
            sup.kill_primary(first)
            load.wait_ok(5, timeout=60)
        finally:
            load.stop()
        assert load.failures == [] and load.ok >= 10
        second = sup.status()["primary"]
        leave_a_request(
            sup.router, {"prompt_token_ids": [7], "max_tokens": 500, "ignore_eos": True}
        )
        complete(sup.router, None, prompt_token_ids=[1], max_tokens=1)  # after the one left
        assert sup.stop(signal.SIGTERM) == 0, sup.output()
        # the router dropped the upstream request, so the engine stopped generating
        log = (sup.run / "logs" / f"{second}.0.log").read_text()
        ended = [json.loads(line) for line in log.splitlines() if ENDED_EARLY in line]
        assert len(ended) == 1 and ended[0]["reason"] == "cancelled", log[-3000:]
        assert ended[0]["tokens"] < 500
    finally:
        if sup.proc.poll() is None:
            sup.stop(signal.SIGKILL)


def test_forked_tp2_reference_engines_register_and_replace_a_broken_group(
    tmp_path: Path, tiny_model: Path
) -> None:
    """Forked ranks start in milliseconds: rank 0 says Hello before its sibling is even
    forked. Both groups must still register, and losing a rank replaces the group."""
    policy = write_policy(
        tmp_path / "policy.yaml",
        tiny_model,
        tmp_path / "run",
        model={"tp_size": 2},
        devices={"ids": ["cpu", "cpu"]},
        engines={"command": ["{python}", "-m", "engine"], "ready_timeout_s": 120},
        heartbeat={"interval_ms": 100, "miss_limit": 10},
    )
    sup = Supervisor(policy)
    try:
        first = sup.wait_pair()
        assert "forkserver ready" in (sup.run / "logs" / "forkserver.log").read_text()
        engines = {e["name"]: e for e in sup.status()["engines"]}
        assert all(len(e["pids"]) == 2 for e in engines.values())
        code, body = complete(sup.router, None, prompt_token_ids=[1, 2, 3], max_tokens=4)
        assert code == 200, body
        mark = sup.tap.mark()
        os.kill(engines[first.name]["pids"][1], signal.SIGKILL)
        second = sup.wait(lambda e: e.event == "promoted", timeout=10, after=mark)
        assert second.name != first.name
        sup.wait(lambda e: e.topic == f"engine.{first.name}.ready", timeout=60, after=mark)
        code, body = complete(sup.router, None, prompt_token_ids=[4, 5], max_tokens=2)
        assert code == 200, body
        assert sup.stop(signal.SIGTERM) == 0, sup.output()
    finally:
        if sup.proc.poll() is None:
            sup.stop(signal.SIGKILL)
