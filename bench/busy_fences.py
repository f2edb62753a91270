"""False fences on a busy machine: the demo's pool, every core kept busy, SIGSTOPs of the
primary now and then.

Runs one real `supervisor run` with the demo's pool (the reference engine on the tiny
checkpoint: one primary, one standby, one batch engine; heartbeat 50 ms x 4) while
`--spinners` processes (`python3 -c "while True: pass"`, started before the supervisor and
stopped at the end by this script) keep the cores busy. Every `--stop-every` seconds, once
a standby is ready, it SIGSTOPs the primary and times the promotion (signal -> the
`promoted` event on ipc://<run>/events). Every other fence, promotion, death or daemon
hang is a false one: nothing was injected for it.

    python bench/busy_fences.py --minutes 30 --out bench/results/busy-fences/run.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.failover import loadavg, machine, summary  # noqa: E402
from holdfast_contract.events import Event  # noqa: E402
from tests.engines.harness import Supervisor, free_port, get  # noqa: E402

SPIN = "while True: pass"
ENGINE_BAR_MS = 250.0  # SIGSTOP -> promoted, p99


def policy(base: Path, engine: str) -> Path:
    """The demo policy (policies/demo.yaml) on free ports and a private runtime dir, no
    MQTT, and a restart budget that many injected fences do not exhaust."""
    p: dict[str, Any] = yaml.safe_load((REPO / "policies" / "demo.yaml").read_text())
    p["cache"]["runtime_dir"] = str(base / "run")
    p["router"]["listen"] = f"127.0.0.1:{free_port()}"
    p["api"]["listen"] = f"127.0.0.1:{free_port()}"
    p.pop("events", None)
    if engine == "echo":
        p["engines"]["command"] = ["{python}", "-m", "tests.engines.echo"]
    p["restart"] = {"max_restarts": 100000, "window_s": 60}
    p["log"] = {"level": "warning"}
    path = base / "policy.yaml"
    path.write_text(yaml.safe_dump(p))
    return path


class Spinners:
    """`n` busy loops, one process each, killed by `stop()`."""

    def __init__(self, n: int) -> None:
        self.procs = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(n)]

    def stop(self) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()


def until_pool(sup: Supervisor, timeout: float) -> None:
    """Until a primary serves and every other engine is ready (standby or batch)."""
    deadline = time.monotonic() + timeout
    while True:
        mark = sup.tap.mark()
        engines = get(f"{sup.api}/cluster")[1]["engines"]
        if sum(e["state"] == "primary" for e in engines) == 1 and all(
            e["state"] in ("primary", "standby", "batch") for e in engines
        ):
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"the pool did not come up within {timeout} s: {engines}")
        # look again after 5 s at most: a move may have come between the look and the mark
        with contextlib.suppress(AssertionError):
            sup.wait(lambda e: e.event in ("ready", "promoted"), timeout=min(left, 5.0), after=mark)


def inject(sup: Supervisor) -> dict[str, Any]:
    """SIGSTOP the primary; its promotion and fence, timed from the signal."""
    old = get(f"{sup.api}/primary")[1]
    mark = sup.tap.mark()
    t0 = time.time()
    os.kill(old["pid"], signal.SIGSTOP)
    promoted = sup.wait(lambda e: e.event == "promoted", timeout=10, after=mark)
    fenced = sup.wait(lambda e: e.topic == f"engine.{old['name']}.fenced", timeout=10, after=mark)
    return {
        "victim": old["name"],
        "pid": old["pid"],
        "t": t0,
        "promoted": promoted.name,
        "promoted_ms": round((promoted.ts - t0) * 1000, 2),
        "silent_ms": promoted.data.get("silent_ms"),
        "supervisor_promote_ms": promoted.data.get("promote_ms"),
        "fence_detail": fenced.data.get("detail"),
    }


def classify(events: list[Event], trials: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The fences, promotions, deaths and daemon hangs no injection explains."""

    def explained(ev: Event) -> bool:
        if ev.event == "promoted" and ev.data.get("cause") == "no-primary" and ev.epoch == 1:
            return True  # the first primary, at start
        for t in trials:
            if not (t["t"] <= ev.ts <= t["t"] + 10.0):
                continue
            if ev.name == t["victim"] and ev.event in ("fenced", "died"):
                return True
            if ev.event == "promoted" and ev.name == t["promoted"]:
                return True
        return False

    kinds = {"fenced": "false_fences", "promoted": "false_promotions", "died": "deaths"}
    out: dict[str, list[dict[str, Any]]] = {k: [] for k in (*kinds.values(), "daemon_hangs")}
    for ev in events:
        row = {"topic": ev.topic, "ts": ev.ts, "epoch": ev.epoch, **ev.data}
        if ev.kind == "daemon" and ev.event == "hung":
            out["daemon_hangs"].append(row)
        elif ev.kind == "engine" and ev.event in kinds and not explained(ev):
            out[kinds[ev.event]].append(row)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--spinners", type=int, default=2, help="busy-loop processes (0: none)")
    ap.add_argument("--stop-every", type=float, default=30.0, help="seconds between SIGSTOPs")
    ap.add_argument(
        "--engine",
        choices=("demo", "echo"),
        default="demo",
        help="demo: the reference engine, as policies/demo.yaml; echo: tests/engines/echo.py",
    )
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "busy-fences" / "run.json"))
    args = ap.parse_args()
    if args.minutes <= 0 or args.stop_every <= 0 or args.spinners < 0:
        ap.error("--minutes and --stop-every must be > 0, --spinners >= 0")
    started = datetime.datetime.now(datetime.UTC)
    base = Path(tempfile.mkdtemp(prefix="hf-busy-"))
    spinners = Spinners(args.spinners)
    trials: list[dict[str, Any]] = []
    load = {"start": loadavg(), "samples": []}
    sup = Supervisor(policy(base, args.engine))
    try:
        sup.wait(lambda e: e.topic == "supervisor.main.started", timeout=300)
        until_pool(sup, timeout=300)
        t_end = time.monotonic() + args.minutes * 60
        while time.monotonic() < t_end:
            next_at = time.monotonic() + args.stop_every
            until_pool(sup, timeout=300)
            trials.append(inject(sup))
            load["samples"].append(loadavg()[0])
            print(json.dumps(trials[-1]), flush=True)
            time.sleep(max(0.0, min(next_at, t_end) - time.monotonic()))
        until_pool(sup, timeout=300)  # a fence after the last injection is still counted
        events = list(sup.tap.events)
    finally:
        code = sup.stop(signal.SIGTERM)
        spinners.stop()
    report(args, started, trials, events, {**load, "end": loadavg()}, code)
    return 0


def report(
    args: argparse.Namespace,
    started: datetime.datetime,
    trials: list[dict[str, Any]],
    events: list[Event],
    load: dict[str, Any],
    code: int,
) -> None:
    unexplained = classify(events, trials)
    promoted = summary([t["promoted_ms"] for t in trials])
    samples = load.pop("samples")
    out = {
        "benchmark": "busy_fences",
        "command": " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]),
        "date": started.isoformat(timespec="seconds"),
        "ended": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": git_head(),
        # 1-minute load averages against `cores`: the spinners, and whatever else the
        # machine ran meanwhile (it is shared: other work loads it too)
        "machine": {**machine(), "loadavg": {**load, "max_1min": max(samples, default=0.0)}},
        "engine": args.engine,
        "spinners": args.spinners,
        "minutes": args.minutes,
        "stop_every_s": args.stop_every,
        "sigstops": len(trials),
        "sigstop_to_promoted_ms": promoted,
        "silent_ms": summary([float(t["silent_ms"]) for t in trials if t["silent_ms"]]),
        **{k: len(v) for k, v in unexplained.items()},
        "unexplained": unexplained,
        "supervisor_exit": code,
        "bars": {
            "zero_false_fences": not unexplained["false_fences"]
            and not unexplained["false_promotions"]
            and not unexplained["daemon_hangs"],
            f"sigstop_p99_under_{int(ENGINE_BAR_MS)}ms": promoted["p99"] is not None
            and promoted["p99"] < ENGINE_BAR_MS,
        },
        "notes": [
            "p99 of n sorted samples is the one at index round(0.99*(n-1)): the max for n <= 50.",
            "false_fences / false_promotions / deaths / daemon_hangs: events no SIGSTOP "
            "explains (an injection explains its victim's fence and death and one promotion "
            "within 10 s of the signal).",
        ],
        "trials": trials,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "trials"}, indent=2))


def git_head() -> str:
    cp = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return cp.stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
