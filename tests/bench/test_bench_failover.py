"""bench/failover.py records how busy the machine was (its measured load averages) instead
of a sentence written in advance about it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.engines.harness import REPO, env


def test_failover_bench_records_the_measured_load(tmp_path: Path) -> None:
    out = tmp_path / "failover.json"
    cp = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "failover.py"),
            *("--kills", "1", "--hangs", "0", "--daemon-kills", "0", "--out", str(out)),
        ],
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert cp.returncode == 0, cp.stdout[-2000:] + cp.stderr[-2000:]
    result = json.loads(out.read_text())
    load = result["machine"]["loadavg"]
    for key in ("start", "end"):
        assert len(load[key]) == 3 and all(x >= 0 for x in load[key]), load
    assert load["max_1min"] >= 0 and result["machine"]["cores"] == os.cpu_count()
    assert not any("busy" in n or "running on it" in n for n in result["notes"]), result["notes"]
    assert result["counts"]["kill"] == 1
