"""What the exit watch costs the supervisor's CPU: one event loop watching one idle
process, with the looks run as SCHED_FIFO (`heartbeat.realtime_promotion: true`) and
without, in turn. Reports the share of a core the process used and the CPU per look.

    python bench/exitwatch_cost.py --seconds 20 --rounds 2 --out bench/results/exitwatch_cost.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from supervisor.exitwatch import ExitWatch  # noqa: E402
from supervisor.realtime import RealtimeSection  # noqa: E402


class Counted(ExitWatch):
    """An exit watch that counts its looks."""

    looks = 0

    def poll(self) -> int | None:
        self.looks += 1
        return super().poll()


async def one(realtime: bool, seconds: float, interval_s: float) -> dict[str, float | int]:
    child = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
    rt = RealtimeSection(True) if realtime else None
    watch = Counted(interval_s, lambda key, pid: None, rt)
    try:
        watch.watch("idle", [child.pid])
        await asyncio.sleep(1.0)  # settled
        looks0, cpu0, t0 = watch.looks, time.process_time(), time.monotonic()
        await asyncio.sleep(seconds)
        looks, cpu, wall = watch.looks - looks0, time.process_time() - cpu0, time.monotonic() - t0
    finally:
        await watch.close()
        child.kill()
        child.wait()
    return {
        "realtime": bool(rt is not None and rt.enabled),
        "looks": looks,
        "cpu_pct_of_a_core": round(cpu / wall * 100, 2),
        "cpu_us_per_look": round(cpu / looks * 1e6, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--interval-ms", type=float, default=2.0, help="heartbeat.exit_poll_ms")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    runs = [
        asyncio.run(one(realtime, a.seconds, a.interval_ms / 1000.0))
        for _ in range(a.rounds)
        for realtime in (True, False)
    ]
    out = {
        "benchmark": "exitwatch_cost",
        "command": "python bench/exitwatch_cost.py " + " ".join(sys.argv[1:]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"host": platform.node(), "cores": os.cpu_count(), "load": os.getloadavg()},
        "runs": runs,
    }
    text = json.dumps(out, indent=2) + "\n"
    if a.out is None:
        sys.stdout.write(text)
    else:
        a.out.write_text(text)
        for run in runs:
            print(run)


if __name__ == "__main__":
    main()
