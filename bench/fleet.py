"""Fleet benchmark: 3 nodes in network namespaces, a 3-member etcd, a `supervisor run` per
node (echo engine, tiny checkpoint), clients through every node's router, and faults:

  kill-node                SIGKILL everything in the leader's namespace; restart it (it
                           rejoins as a follower). Failover: kill -> first answer, through a
                           surviving router, of a newer cluster epoch.
  partition-node           the leader's node cut off for hold_s: it must stop serving within
                           ttl_s; overlap of two epochs from the response log must be 0.
  kill-etcd-member         one member of three down for hold_s: no leader change, 0 failed.
  kill-etcd-all            all three down for hold_s: the leader serves until its lease
                           would expire, then stops; serving again once etcd is back.
  pause-leader-supervisor  SIGSTOP the leader's supervisor for hold_s (> ttl_s), SIGCONT.

Two configurations: ttl_s 2 with etcd's defaults, and ttl_s 1 with etcd run at
--heartbeat-interval 50 --election-timeout 500 (etcd grants no shorter lease otherwise).
Needs root, iproute2 and etcd.

    python bench/fleet.py                    # the full run (30 kill-node trials per config)
    python bench/fleet.py --quick --configs ttl1 --out /tmp/fleet-quick
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import msgspec

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from chaos.fleet.faults import FleetTrial  # noqa: E402
from chaos.fleet.kinds import FleetConfig  # noqa: E402
from chaos.fleet.net import missing  # noqa: E402
from chaos.fleet.run import Step, run_fleet  # noqa: E402

CONFIGS = {
    "ttl2": FleetConfig(ttl_s=2),
    "ttl1": FleetConfig(ttl_s=1, etcd_flags="--heartbeat-interval 50 --election-timeout 500"),
}


def steps(args: argparse.Namespace, ttl: int) -> list[Step]:
    q = args.quick
    plan = [
        Step("kill-node", 2 if q else args.kill_trials, 0.0),
        Step("partition-node", 1 if q else args.partition_trials, 3.0 * ttl),
        Step("kill-etcd-member", 1 if q else args.etcd_member_trials, 2.0 * ttl),
        Step("pause-leader-supervisor", 1 if q else args.pause_trials, 2.0 * ttl),
        Step("kill-etcd-all", 1 if q else args.etcd_all_trials, 3.0 * ttl),
    ]
    return [s for s in plan if s.trials > 0]


def machine() -> dict[str, Any]:
    cpus = 0
    model = ""
    try:
        info = Path("/proc/cpuinfo").read_text()
        cpus = info.count("processor\t:")
        model = next(
            (ln.split(":", 1)[1].strip() for ln in info.splitlines() if "model name" in ln), ""
        )
    except OSError:
        pass
    return {"host": platform.node(), "kernel": platform.release(), "cpus": cpus, "cpu": model,
            "python": platform.python_version()}  # fmt: skip


def source() -> str:
    """The commit measured (with `+dirty` when the tree differs from it), or why unknown."""
    git = ["git", "-C", str(REPO)]
    try:
        head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True)  # fmt: skip
    except OSError as exc:
        return f"unknown ({exc})"
    if head.returncode != 0:
        return "unknown (not a git checkout)"
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def show(trial: FleetTrial) -> None:
    keys = ("failover_ms", "stopped_serving_ms", "serve_again_ms", "rejoin_ms", "overlap_ms")
    got = " ".join(f"{k}={getattr(trial, k)}" for k in keys if getattr(trial, k) is not None)
    print(
        f"  {trial.kind} #{trial.index} victim={trial.victim}"
        f"{' (raft leader)' if trial.etcd_leader else ''} {trial.old_leader}@"
        f"{trial.old_epoch}->{trial.new_leader}@{trial.new_epoch} {got} "
        f"failed={trial.failed_requests} (victim's clients {trial.failed_elsewhere})",
        flush=True,
    )


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--kill-trials", type=int, default=30)
    p.add_argument("--partition-trials", type=int, default=3)
    p.add_argument("--etcd-member-trials", type=int, default=4)
    p.add_argument("--pause-trials", type=int, default=2)
    p.add_argument("--etcd-all-trials", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="2 kill-node trials, 1 of each other kind")
    p.add_argument("--configs", default="ttl2,ttl1", help="comma-separated: ttl2, ttl1")
    p.add_argument("--note", default="", help="kept in the result: what was measured, if not HEAD")
    p.add_argument("--keep", type=Path, help="keep node logs and the response log in this dir")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "fleet")
    args = p.parse_args()
    why = missing()
    if why is not None:
        print(f"fleet bench: {why}", file=sys.stderr)
        return 2
    names = [c for c in args.configs.split(",") if c]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        print(
            f"fleet bench: unknown config {unknown}; valid: {', '.join(CONFIGS)}", file=sys.stderr
        )
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    failed = False
    for name in names:
        config = CONFIGS[name]
        print(f"{name}: ttl_s={config.ttl_s} etcd flags={config.etcd_flags!r}", flush=True)
        started = datetime.datetime.now(datetime.UTC)
        load_before = list(os.getloadavg())
        if args.keep is not None:  # node logs, policies and responses.jsonl kept there
            work = args.keep / name
            work.mkdir(parents=True, exist_ok=True)
            results = run_fleet(work, config, steps(args, config.ttl_s), on_trial=show)
        else:
            with tempfile.TemporaryDirectory(prefix="hf-fleet-") as tmp:
                results = run_fleet(Path(tmp), config, steps(args, config.ttl_s), on_trial=show)
        doc = {
            "command": shlex.join([sys.executable, *sys.argv]),
            "date": started.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "machine": machine(),
            "source": source(),
            "note": args.note,
            "loadavg_before": load_before,
            "loadavg_after": list(os.getloadavg()),
            "config": name,
            **msgspec.to_builtins(results),
        }
        path = args.out / f"fleet_{name}{'_quick' if args.quick else ''}.json"
        path.write_text(json.dumps(doc, indent=1) + "\n")
        print(json.dumps(results.figures["per_fault"], indent=1))
        print(f"errors: {results.errors}" if results.errors else "errors: none")
        print(f"written: {path}")
        failed = failed or bool(results.errors) or bool(results.figures["left_behind"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
