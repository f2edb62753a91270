"""Where the stall of each kill-primary trial went, for its worst stream, from the trace
lines `trace.patch` makes the router and the engines write (/tmp/migtrace/*.jsonl) and the
run's results.json.

    python3 breakdown.py OUT_DIR [FAULT_KIND] [-v]
"""

from __future__ import annotations

import glob
import gzip
import json
import statistics
import sys
from pathlib import Path
from typing import Any


def lines(pattern: str) -> list[dict[str, Any]]:
    return [json.loads(ln) for f in glob.glob(pattern) for ln in Path(f).read_text().splitlines()]


def trial_row(
    t: dict[str, Any], router: list[dict[str, Any]], engine: list[dict[str, Any]]
) -> dict[str, Any] | None:
    t0 = t["injected"]

    def near(x: float) -> bool:
        return 0.0 < x - t0 < 1.0

    promote = [x["t"] for x in router if x["ev"] == "promote" and near(x["t"])]
    resumed = [x for x in router if x["ev"] == "resumed" and near(x["t"])]
    if not promote or not resumed:
        return None
    worst = max(resumed, key=lambda x: x["stall"])
    mine = {x["ev"]: x["t"] for x in router if x.get("s") == worst["s"] and near(x["t"])}
    arrived = sorted(
        x["t"] for x in engine if x["ev"] == "arrive" and near(x["t"]) and x["t"] < worst["t"]
    )
    steps = [
        x
        for x in engine
        if x["ev"] == "step" and near(x["t0"]) and arrived and arrived[0] < x["t0"] < worst["t"]
    ]
    nan = float("nan")
    return {
        "trial": t["index"],
        "client_stall": t["stream_stall_ms"],
        "router_stall": worst["stall"] * 1e3,
        "last_token_to_fault": (t0 - (worst["t"] - worst["stall"])) * 1e3,
        "fault_to_promote": (promote[0] - t0) * 1e3,
        "promote_to_cut": (mine.get("cut", nan) - promote[0]) * 1e3,
        "cut_to_post": (mine.get("post", nan) - mine.get("cut", nan)) * 1e3,
        "post_to_last_arrival": (arrived[-1] - mine.get("post", nan)) * 1e3 if arrived else nan,
        "prefill_steps": len(steps),
        "prefill_ms": sum(x["t1"] - x["t0"] for x in steps) * 1e3,
        "prefill_tokens": sum(x["ptok"] for x in steps),
        "step_end_to_resumed": (worst["t"] - max(x["t1"] for x in steps)) * 1e3 if steps else nan,
    }


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("-")]
    out, kind = Path(args[0]), args[1] if len(args) > 1 else "kill-primary"
    path = out / "results.json"
    if path.exists():
        results = json.loads(path.read_text())
    else:
        with gzip.open(f"{path}.gz") as f:
            results = json.load(f)
    router, engine = lines("/tmp/migtrace/router-*.jsonl"), lines("/tmp/migtrace/eng-*.jsonl")
    trials = [t for t in results["trials"] if t["fault"] == kind and t.get("stream_stall_ms")]
    rows = [r for r in (trial_row(t, router, engine) for t in trials) if r is not None]
    print(f"{len(rows)} {kind} trials; the worst stream of each")
    for key in [k for k in rows[0] if k != "trial"] if rows else []:
        v = sorted(r[key] for r in rows if r[key] == r[key])
        if v:
            p50, p90 = v[len(v) // 2], v[min(len(v) - 1, int(0.9 * len(v)))]
            mean = statistics.mean(v)
            print(f"{key:22} p50 {p50:7.1f}  p90 {p90:7.1f}  max {v[-1]:7.1f}  mean {mean:7.1f}")
    if "-v" in sys.argv:
        for r in sorted(rows, key=lambda r: -r["client_stall"]):
            print({k: round(v, 1) for k, v in r.items()})


if __name__ == "__main__":
    main()
