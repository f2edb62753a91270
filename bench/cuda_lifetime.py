"""What happens to GPU memory when the daemon, a client or the keeper dies: nvidia-smi's
memory.used after each step of one scenario (the numbers behind docs/memory-lifetime.md).

    PYTHONPATH=. python bench/cuda_lifetime.py --model /tmp/models/moe --out lifetime.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.cuda_procs import Proc, env, gpu_used_mib, stamp

HOLD = r"""
import sys, torch
from cachedaemon.client import attach_state_dict
sd = attach_state_dict(sys.argv[1])
print(len(sd), flush=True)
sys.stdin.read()
"""


class Client:
    """A process that attaches and holds its mappings until killed."""

    def __init__(self, sock: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLD, str(sock)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env(),
        )
        assert self.proc.stdout is not None
        if not self.proc.stdout.readline().strip():
            raise RuntimeError("client did not attach")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(30)


def reading(steps: list[dict[str, Any]], what: str, base: int) -> None:
    at_once = gpu_used_mib()
    time.sleep(1.0)  # a second reading shows whether a release is still under way
    later = gpu_used_mib()
    steps.append(
        {
            "step": what,
            "used_mib": at_once,
            "used_mib_1s_later": later,
            "over_baseline_mib": later - base,
        }
    )
    print(json.dumps(steps[-1]), flush=True)


def scenario(model: Path, run: Path) -> list[dict[str, Any]]:
    steps: list[dict[str, Any]] = []
    base = gpu_used_mib()
    steps.append({"step": "baseline", "used_mib": base})
    ksock, sock = run / "keeper.sock", run / "daemon-0.sock"
    serve = (
        "serve",
        "--model",
        str(model),
        "--device",
        "cuda:0",
        "--runtime-dir",
        str(run),
        "--keeper",
        str(ksock),
    )
    keeper = Proc("keeper", "--socket", str(ksock))
    keeper.wait_for("keeper serving", 60)
    daemon = Proc(*serve)
    daemon.wait_for("serving", 300)
    reading(steps, "keeper + daemon serving (pool loaded)", base)
    client = Client(sock)
    reading(steps, "a client attached", base)
    daemon.kill()
    reading(steps, "daemon killed -9 (keeper and client hold the pool)", base)
    client.kill()
    reading(steps, "client killed -9 (only the keeper's fds hold the pool)", base)
    daemon = Proc(*serve)
    daemon.wait_for("serving", 300)
    steps[-1]["adopted"] = (daemon.event("pool ready") or {}).get("adopted")
    reading(steps, "daemon restarted (reclaimed from the keeper)", base)
    keeper.kill()
    reading(steps, "keeper killed -9 (the daemon holds the pool)", base)
    client = Client(sock)
    daemon.kill()
    reading(steps, "client attached, then daemon killed -9 (keeper gone too)", base)
    client.kill()
    reading(steps, "client killed -9 (nobody holds the pool)", base)
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    run = Path("/tmp/holdfast-run-lifetime")
    result = {**stamp(sys.argv), "model": str(args.model), "steps": scenario(args.model, run)}
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
