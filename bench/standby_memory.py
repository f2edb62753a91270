"""Device memory per engine process, a standby's beside the primary's, with the KV cache
shared (`engines.kv_adopt: true`: a standby keeps a small cache until it is promoted)
and without (today's standby: a whole KV cache of its own), in one run.

For each mode one real `supervisor run` of the policy (its events section dropped) comes
up, its engines ready; then, per engine process (the supervisor's `status --json` pids),
nvidia-smi's used memory (on a CPU machine: none, and the process's RSS instead), and the
supervisor is stopped before the next mode starts.

    python bench/standby_memory.py --policy chaos/scenarios/policy-gpu.yaml --out X.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.cuda_procs import gpu_apps  # noqa: E402
from holdfast_contract.wire import free_port  # noqa: E402
from tests.engines.harness import Supervisor  # noqa: E402

MODES = {"private": False, "shared": True}  # engines.kv_adopt


def write_policy(base: Path, run: Path, out: Path, adopt: bool, standby: int) -> Path:
    p = yaml.safe_load(base.read_text())
    p["cache"] = {**p.get("cache", {}), "runtime_dir": str(run)}
    p["router"] = {**p.get("router", {}), "listen": f"127.0.0.1:{free_port()}"}
    p["api"] = {**p.get("api", {}), "listen": f"127.0.0.1:{free_port()}"}
    p.pop("events", None)
    eng = p.setdefault("engines", {})
    eng["standby"] = standby
    eng.pop("batch", None)
    eng["kv_adopt"] = adopt
    out.write_text(yaml.safe_dump(p))
    return out


def rss_mb(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) // 1024
    except OSError:
        return None
    return None


def measure(sup: Supervisor, timeout: float, standby: int) -> list[dict[str, Any]]:
    sup.wait_pair(timeout=timeout)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        engines = sup.status()["engines"]
        ready = [e for e in engines if e["state"] in ("primary", "standby")]
        if len(ready) == 1 + standby:
            break
        time.sleep(0.5)
    else:
        raise SystemExit(f"the crew was not up within {timeout} s: {sup.status()['engines']}")
    time.sleep(3.0)  # the engines' graphs are captured after ready, between steps
    per = gpu_apps()
    return [
        {
            "name": e["name"],
            "state": e["state"],
            "pid": e["pid"],
            "gpu_mb": per.get(e["pid"]),
            "rss_mb": rss_mb(e["pid"]),
        }
        for e in sup.status()["engines"]
    ]


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--policy", type=Path, required=True)
    ap.add_argument("--standby", type=int, default=2)
    ap.add_argument("--ready-timeout", type=float, default=300)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    result: dict[str, Any] = {
        "command": " ".join([sys.executable, *sys.argv]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "modes": {},
    }
    for mode, adopt in MODES.items():
        work = Path(tempfile.mkdtemp(prefix=f"holdfast-standby-memory-{mode}-"))
        policy = write_policy(args.policy, work / "run", work / "policy.yaml", adopt, args.standby)
        sup = Supervisor(policy)
        try:
            engines = measure(sup, args.ready_timeout, args.standby)
        finally:
            sup.stop()
        result["modes"][mode] = {"kv_adopt": adopt, "engines": engines}
        for e in engines:
            print(
                f"{mode:8} {e['state']:8} {e['name']:12} gpu {e['gpu_mb']} MiB  rss {e['rss_mb']} MiB"
            )
        args.out.write_text(json.dumps(result, indent=2))
    standby = {
        mode: [e["gpu_mb"] for e in m["engines"] if e["state"] == "standby" and e["gpu_mb"]]
        for mode, m in result["modes"].items()
    }
    if standby["private"] and standby["shared"]:
        ratio = max(standby["shared"]) / min(standby["private"])
        result["standby_shared_over_private"] = round(ratio, 3)
        print(f"a standby's device memory, shared over private: {ratio:.3f}")
    args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
