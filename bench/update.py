"""A rolling update, a refit and a stop-and-start, under streaming load, in one run.

One real `supervisor run` on checkpoint A (a policy file's crew; its events section is
dropped), CLIENTS streaming clients through its router (PROMPT token ids, MAX_TOKENS
answer tokens, ignore_eos) the whole time. Then:

1. `update` to checkpoint B (same shapes, other weights): from the command to the new
   primary serving (the `switched` event; and the first token a client got from the new
   version), against the new pool's load time (its daemon's own `pool ready` seconds, and
   the command to its `serving` event);
2. `refit` back to A (its files in the page cache: the new tensors in host memory): from the
   command to every engine refitted (each engine's `refitted` event, its own swap ms), and
   the serving stall: each stream's longest gap between two tokens in the refit's window,
   p50/p99 over the streams under way, beside the same gap measured in a quiet window;
3. the baseline: the supervisor stopped, and started afresh on B: from the stop to its
   first answer.

Every answer's status, [DONE], token count and version header is checked: failed, broken
(no [DONE] or fewer tokens than asked) and unlabelled answers are counted, and an answer
whose version is neither A's nor B's.

    python bench/update.py --policy chaos/scenarios/policy-gpu.yaml \\
        --model-a /tmp/models/llama-8b --model-b /tmp/models/llama-8b-b --out update.json
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from holdfast_contract.control import RefitReq, UpdateReq  # noqa: E402
from holdfast_contract.wire import free_port  # noqa: E402
from supervisor.control import request  # noqa: E402
from tests.engines.harness import Supervisor, topic  # noqa: E402

VERSION = "X-Holdfast-Model-Version"


class Answer:
    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.status = 0
        self.version = ""
        self.times: list[float] = []  # time.time() of each token's chunk
        self.tokens = 0
        self.done = False
        self.error = ""


class Clients:
    """Streaming clients in threads, each asking again as soon as its answer ends."""

    def __init__(self, router: str, n: int, prompt: int, max_tokens: int, vocab: int) -> None:
        host, _, port = router.removeprefix("http://").partition(":")
        self.addr = (host, int(port))
        self.prompt, self.max_tokens, self.vocab = prompt, max_tokens, vocab
        self.answers: list[Answer] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.run, args=(i,), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def run(self, i: int) -> None:
        rng = random.Random(i)
        while not self.stop.is_set():
            prompt = [rng.randrange(3, self.vocab) for _ in range(self.prompt)]
            a = self.ask(prompt)
            with self.lock:
                self.answers.append(a)

    def ask(self, prompt: list[int]) -> Answer:
        a = Answer(time.time())
        body = {
            "prompt": prompt,
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        conn = http.client.HTTPConnection(*self.addr, timeout=120)
        try:
            conn.request(
                "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
            )
            resp = conn.getresponse()
            a.status, a.version = resp.status, resp.getheader(VERSION, "")
            if resp.status != 200:
                a.error = resp.read().decode(errors="replace")[:300]
                return a
            for raw in resp:
                line = raw.strip()
                if line == b"data: [DONE]":
                    a.done = True
                elif line.startswith(b"data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        a.error = json.dumps(chunk["error"])[:300]
                    got = sum(len(c.get("token_ids") or []) for c in chunk.get("choices", []))
                    if got:
                        a.tokens += got
                        a.times.append(time.time())
        except (OSError, http.client.HTTPException, ValueError) as e:
            a.error = repr(e)
        finally:
            conn.close()
        return a

    def finish(self) -> list[Answer]:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=300)
        return self.answers


def ev_ts(sup: Supervisor, pred: Any, after: int, timeout: float = 600) -> Any:
    return sup.wait(pred, timeout=timeout, after=after)


def pool_seconds(run: Path, gen: int) -> float | None:
    """The daemon's own load time of generation `gen`'s pool (its log's `pool ready`)."""
    logs = run / f"gen-{gen}" / "logs"
    for f in sorted(logs.glob("daemon-0*.log")) if logs.exists() else []:
        for line in f.read_text(errors="replace").splitlines():
            if "pool ready" in line:
                m = re.search(r"seconds\W+([0-9.]+)", line)
                if m:
                    return float(m.group(1))
    return None


def stalls(answers: list[Answer], lo: float, hi: float) -> list[float]:
    """Each stream under way in [lo, hi]: its longest gap between two tokens there (ms)."""
    out = []
    for a in answers:
        ts = [t for t in a.times if lo <= t <= hi]
        before = [t for t in a.times if t < lo]
        if before:
            ts = [before[-1], *ts]
        if len(ts) >= 2 and a.times and a.times[-1] > lo:
            out.append(max(b - x for x, b in zip(ts, ts[1:], strict=False)) * 1e3)
    return out


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(q * len(s)))], 2)


def summary(xs: list[float]) -> dict[str, Any]:
    return {
        "n": len(xs),
        "p50": pct(xs, 0.5),
        "p99": pct(xs, 0.99),
        "max": round(max(xs), 2) if xs else None,
    }


def write_policy(base: Path, model: Path, run: Path, out: Path, args: argparse.Namespace) -> Path:
    p = yaml.safe_load(base.read_text())
    p["model"] = {**p.get("model", {}), "path": str(model)}
    p["model"].pop("preset", None)
    p["cache"] = {**p.get("cache", {}), "runtime_dir": str(run)}
    p["router"] = {**p.get("router", {}), "listen": f"127.0.0.1:{free_port()}"}
    p["api"] = {**p.get("api", {}), "listen": f"127.0.0.1:{free_port()}"}
    p.pop("events", None)
    eng = p.setdefault("engines", {})
    eng["standby"] = args.standby
    if args.no_batch:
        eng.pop("batch", None)
    if args.memory_mb:
        eng["memory_mb"] = args.memory_mb
    p["update"] = {"keep_old_s": 0, "drain_s": args.drain_s, "ready_timeout_s": 300}
    for kv in args.set:  # after the bench's own settings: --set update.X=... holds
        key, _, value = kv.partition("=")
        *path, leaf = key.split(".")
        node = p
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    out.write_text(yaml.safe_dump(p))
    return out


def wait_crew(sup: Supervisor, timeout: float) -> None:
    sup.wait_pair(timeout=timeout)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = sup.status()
        if st["engines"] and all(
            e["state"] in ("primary", "standby", "batch") for e in st["engines"]
        ):
            return
        time.sleep(0.2)
    raise SystemExit(f"the crew was not up within {timeout} s: {sup.status()['engines']}")


def wait_parked(run: Path, timeout: float = 60.0) -> float | None:
    """With update.park on: until the next pool's daemon is parked (listening on
    <run>/parked-0.sock), as it is when a command comes minutes after the last; the seconds
    waited, or None when nothing is parked here."""
    if not (run / "logs" / "daemon-0-parked.log").exists():
        return None
    t0 = time.monotonic()
    while not (run / "parked-0.sock").exists() and time.monotonic() - t0 < timeout:
        time.sleep(0.05)
    return round(time.monotonic() - t0, 3)


def first_token_of(answers: list[Answer], version: str, after: float) -> float | None:
    ts = [t for a in answers if a.version == version for t in a.times if t >= after]
    return min(ts) if ts else None


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--policy", type=Path, required=True)
    ap.add_argument("--model-a", type=Path, required=True)
    ap.add_argument("--model-b", type=Path, required=True)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--standby", type=int, default=1)
    ap.add_argument("--no-batch", action="store_true")
    ap.add_argument("--memory-mb", type=int, default=0)
    ap.add_argument("--drain-s", type=float, default=30.0)
    ap.add_argument("--set", action="append", default=[], help="policy KEY=VALUE (yaml)")
    ap.add_argument("--ready-timeout", type=float, default=600)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--logs", type=Path, help="copy the run's logs here before the baseline")
    args = ap.parse_args()

    vocab = json.loads((args.model_a / "config.json").read_text())["vocab_size"]
    work = Path(tempfile.mkdtemp(prefix="holdfast-update-bench-"))
    result: dict[str, Any] = {
        "command": " ".join([sys.executable, *sys.argv]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "commit": commit(),
        "clients": args.clients,
        "prompt_tokens": args.prompt,
        "max_tokens": args.max_tokens,
        "standby": args.standby,
    }

    def save() -> None:
        args.out.write_text(json.dumps(result, indent=2))

    sup = Supervisor(
        write_policy(args.policy, args.model_a, work / "run", work / "policy.yaml", args)
    )
    clients: Clients | None = None
    try:
        wait_crew(sup, args.ready_timeout)
        endpoint = f"ipc://{sup.run}/control"
        v_a = sup.status()["version"]
        clients = Clients(sup.router, args.clients, args.prompt, args.max_tokens, vocab)
        t_quiet = time.time()
        time.sleep(6.0)
        quiet = (t_quiet + 3.0, time.time())  # past the clients' first prefills

        # 1. update to B
        result["parked_wait_s"] = [wait_parked(sup.run)]
        mark = sup.tap.mark()
        t0 = time.time()
        reply = request(endpoint, UpdateReq(str(args.model_b)), timeout=30)
        if not reply.ok:
            raise SystemExit(f"update refused: {reply.message}")
        served = ev_ts(sup, lambda e: e.event == "serving" and e.name.endswith("-g2"), mark)
        switched = ev_ts(sup, topic("update.main.switched"), mark)
        end = ev_ts(
            sup, lambda e: e.kind == "update" and e.event in ("finished", "rolled-back"), mark
        )
        v_b = switched.data["version"]
        result["update"] = {
            "end": end.event,
            "version_from": v_a,
            "version_to": v_b,
            "command_to_switched_s": round(switched.ts - t0, 3),
            "command_to_pool_serving_s": round(served.ts - t0, 3),
            "pool_load_s": pool_seconds(sup.run, 2),
            "command_to_finished_s": round(end.ts - t0, 3),
            "stall_ms": summary(stalls(clients.answers, t0, end.ts)),
        }
        save()
        time.sleep(3.0)
        # an answer is kept once it ends: B's first ones have by now
        first_b = first_token_of(clients.answers, v_b, t0)
        first_s = round(first_b - t0, 3) if first_b else None
        result["update"]["command_to_first_new_token_s"] = first_s
        save()

        # 2. refit back to A (its files are in the page cache)
        result["parked_wait_s"].append(wait_parked(sup.run))
        mark = sup.tap.mark()
        names = [e["name"] for e in sup.status()["engines"]]
        t0 = time.time()
        reply = request(endpoint, RefitReq(str(args.model_a)), timeout=30)
        if not reply.ok:
            raise SystemExit(f"refit refused: {reply.message}")
        served = ev_ts(sup, lambda e: e.event == "serving" and e.name.endswith("-g3"), mark)
        switched = ev_ts(sup, topic("update.main.switched"), mark)
        end = ev_ts(
            sup, lambda e: e.kind == "update" and e.event in ("finished", "rolled-back"), mark
        )
        refitted = [e for e in sup.tap.events[mark:] if e.event == "refitted"]
        by_name = {e.name: e for e in refitted}
        last = max((e.ts for e in refitted), default=None)
        result["refit"] = {
            "end": end.event,
            "version_to": switched.data["version"],
            "engines": names,
            "refitted": {
                n: {
                    "at_s": round(e.ts - t0, 3),
                    "ms": e.data.get("ms"),
                    "swap_ms": e.data.get("swap_ms"),
                }
                for n, e in by_name.items()
            },
            "all_engines_refitted": sorted(by_name) == sorted(names),
            "command_to_pool_serving_s": round(served.ts - t0, 3),
            "pool_load_s": pool_seconds(sup.run, 3),
            "command_to_switched_s": round(switched.ts - t0, 3),
            "command_to_every_engine_refitted_s": round(last - t0, 3) if last else None,
            "command_to_finished_s": round(end.ts - t0, 3),
            "stall_ms": summary(stalls(clients.answers, t0, end.ts)),
        }
        result["quiet_stall_ms"] = summary(stalls(clients.answers, *quiet))
        save()
        time.sleep(2.0)
        answers = clients.finish()
        clients = None
        result["answers"] = judge(answers, args.max_tokens, {v_a, v_b})
        save()

        if args.logs is not None:  # the supervisor's, the engines' and every generation's
            for logs in [sup.run / "logs", *sorted(sup.run.glob("gen-*/logs"))]:
                dest = args.logs / logs.relative_to(sup.run)
                shutil.copytree(logs, dest, dirs_exist_ok=True)
            if sup.log.exists():  # the supervisor's own output: its events, the switch
                shutil.copy(sup.log, args.logs / "supervisor.log")

        # 3. the baseline: stop, start afresh on B, first answer
        t0 = time.time()
        sup.stop(signal.SIGTERM, timeout=120)
        t_stopped = time.time()
        shutil.rmtree(work / "run", ignore_errors=True)
        sup2 = Supervisor(
            write_policy(args.policy, args.model_b, work / "run2", work / "policy2.yaml", args)
        )
        try:
            first = first_answer(sup2.router, args.ready_timeout, vocab)
            result["stop_and_start"] = {
                "stop_s": round(t_stopped - t0, 3),
                "start_to_first_answer_s": round(first - t_stopped, 3),
                "stop_to_first_answer_s": round(first - t0, 3),
            }
        finally:
            sup2.stop(signal.SIGTERM, timeout=120)
        save()
    finally:
        if clients is not None:
            clients.finish()
        if sup.proc.poll() is None:
            sup.stop(signal.SIGTERM, timeout=120)
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result, indent=2))
    return 0


def judge(answers: list[Answer], max_tokens: int, versions: set[str]) -> dict[str, Any]:
    failed = [a for a in answers if a.status != 200 or (a.error and not a.times)]
    broken = [a for a in answers if a.status == 200 and (not a.done or a.tokens != max_tokens)]
    return {
        "total": len(answers),
        "failed": len(failed),
        "broken": len(broken),
        "unlabelled": sum(1 for a in answers if a.status == 200 and not a.version),
        "other_version": sum(1 for a in answers if a.version and a.version not in versions),
        "by_version": {v: sum(1 for a in answers if a.version == v) for v in sorted(versions)},
        "errors": sorted({a.error for a in [*failed, *broken] if a.error})[:5],
    }


def first_answer(router: str, timeout: float, vocab: int) -> float:
    host, _, port = router.removeprefix("http://").partition(":")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            body = {"prompt": [5, 6, 7], "max_tokens": 1}
            conn.request(
                "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
            )
            resp = conn.getresponse()
            resp.read()
            if resp.status == 200:
                return time.time()
        except (OSError, http.client.HTTPException):
            pass
        finally:
            conn.close()
        time.sleep(0.05)
    raise SystemExit(f"no answer within {timeout} s of the fresh start")


def machine() -> str:
    try:
        gpu = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout.strip()
    except OSError:
        gpu = ""
    return gpu or f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, no GPU"


def commit() -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
    except OSError:
        return ""


if __name__ == "__main__":
    sys.exit(main())
