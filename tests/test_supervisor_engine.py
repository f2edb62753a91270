"""The reference engine (`python -m engine`) under the supervisor: it attaches to the daemon,
is promoted, answers through the router, and a kill -9 of it fails over with no lost request.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from tests.engines.harness import Load, Supervisor, complete, get, write_policy


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
        first = sup.wait(lambda e: e.event == "promoted", timeout=180)
        sup.wait(lambda e: e.event == "ready" and e.name != first.name, timeout=180)
        code, body = complete(sup.router, None, prompt_token_ids=[1, 2, 3], max_tokens=4)
        assert code == 200, body
        load = Load(sup.router, clients=2, prompt=None, prompt_token_ids=[1, 2], max_tokens=2)
        try:
            load.wait_ok(5, timeout=60)
            mark = sup.tap.mark()
            os.kill(get(f"{sup.api}/primary")[1]["pid"], signal.SIGKILL)
            second = sup.wait(lambda e: e.event == "promoted", timeout=5, after=mark)
            assert second.name != first.name and second.epoch == first.epoch + 1
            load.wait_ok(5, timeout=60)
        finally:
            load.stop()
        assert load.failures == [] and load.ok >= 10
        assert sup.stop(signal.SIGTERM) == 0, sup.output()
    finally:
        if sup.proc.poll() is None:
            sup.stop(signal.SIGKILL)
