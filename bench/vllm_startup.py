"""vLLM's OpenAI API server, start to ready: `--load-format holdfast` vs vLLM's default loader.

    PYTHONPATH=. python bench/vllm_startup.py --model-dir /tmp/models/vllm-bench \
        --hidden 2048 --layers 4 --trials 2 --out bench/results/vllm-cpu/startup.json

One cache daemon (float32) holds the checkpoint for the whole run, as it does for a warm
standby. Each trial starts the API server once per loader, in turn, from a fresh process to
its first 200 on /health, and stops it. The checkpoint stays in the page cache (the default
loader's best case: no disk read). Where the start goes is read from vLLM's own log lines:
"Model loading took ... seconds" (build + weights + process_weights_after_loading) and "init
engine (profile, create kv cache, warmup model) took ... s"; the rest is interpreter start,
imports and process spawns (API server, engine core). The memory of each server's process
tree (Rss, Pss, shared) is read from /proc when it is ready.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("HOLDFAST_VLLM_VENV", "/opt/holdfast/vllm-venv"))
LOADERS = ("holdfast", "auto")
PHASES = {
    "model_loading_s": re.compile(
        r"Model loading took [\d.]+ GiB (?:memory )?and ([\d.]+) seconds"
    ),
    "init_engine_s": re.compile(
        r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s"
    ),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def vllm_env(root: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CACHE_ROOT=str(root / "vllm-cache"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    env.pop("HOLDFAST_DAEMONS", None)
    return env


def server_argv(model: Path, port: int, loader: str, sock: Path) -> list[str]:
    argv = [str(VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server"]
    argv += ["--model", str(model), "--dtype", "float32", "--port", str(port)]
    argv += ["--host", "127.0.0.1", "--enforce-eager", "--max-model-len", "256"]
    argv += ["--max-num-seqs", "4", "--distributed-executor-backend", "uni"]
    if loader == "holdfast":
        extra = {"sockets": [str(sock)], "fallback": False, "mode": "zero_copy"}
        argv += ["--load-format", "holdfast", "--model-loader-extra-config", json.dumps(extra)]
    return argv


def tree_memory(pid: int) -> dict[str, float]:
    """Rss, Pss and shared MiB summed over pid and its descendants (smaps_rollup)."""
    pids, i = [pid], 0
    while i < len(pids):
        for task in Path(f"/proc/{pids[i]}/task").glob("*/children"):
            pids += [int(c) for c in task.read_text().split()]
        i += 1
    total = {"rss_mb": 0.0, "pss_mb": 0.0, "shared_mb": 0.0, "processes": float(len(pids))}
    for p in pids:
        for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
            key, _, rest = line.partition(":")
            kb = float(rest.split()[0]) if rest.strip() and rest.split()[0].isdigit() else 0.0
            if key == "Rss":
                total["rss_mb"] += kb / 1024
            elif key == "Pss":
                total["pss_mb"] += kb / 1024
            elif key in ("Shared_Clean", "Shared_Dirty"):
                total["shared_mb"] += kb / 1024
    return {k: round(v, 1) for k, v in total.items()}


def start_once(
    model: Path, loader: str, sock: Path, root: Path, deadline_s: float
) -> dict[str, Any]:
    port = free_port()
    argv = server_argv(model, port, loader, sock)
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=vllm_env(root),
        start_new_session=True,
    )
    lines: list[str] = []
    pump = threading.Thread(target=lambda: lines.extend(proc.stdout or []), daemon=True)
    pump.start()
    try:
        ready_s = wait_healthy(proc, port, t0, deadline_s, lines)
        memory = tree_memory(proc.pid)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        pump.join(10)
    text = "".join(lines)
    phases = {k: float(m.group(1)) for k, rx in PHASES.items() if (m := rx.search(text))}
    if loader == "holdfast" and "weights attached" not in text:
        raise SystemExit(f"the holdfast start did not attach:\n{text[-3000:]}")
    return {"loader": loader, "ready_s": round(ready_s, 2), **phases, "memory": memory}


def wait_healthy(
    proc: subprocess.Popen[str], port: int, t0: float, deadline_s: float, lines: list[str]
) -> float:
    url = f"http://127.0.0.1:{port}/health"
    while time.perf_counter() - t0 < deadline_s:
        if proc.poll() is not None:
            raise SystemExit(f"vLLM exited with {proc.returncode}:\n{''.join(lines)[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return time.perf_counter() - t0
        except OSError:
            time.sleep(0.05)  # vLLM signals readiness only through HTTP
    raise SystemExit(f"vLLM was not ready within {deadline_s} s:\n{''.join(lines)[-3000:]}")


def start_daemon(model: Path, run: Path) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    argv = [sys.executable, "-m", "cachedaemon", "--log-format", "json", "serve"]
    argv += ["--model", str(model), "--runtime-dir", str(run), "--dtype", "float32"]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env=env)
    for line in proc.stderr or []:
        if '"event": "serving"' in line:
            return proc
    raise SystemExit(f"cachedaemon exited with {proc.wait()} before serving")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model-dir", type=Path, required=True, help="made here when missing")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--deadline-s", type=float, default=900.0, help="per start")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if not (args.model_dir / "config.json").is_file():
        sys.path.insert(0, str(REPO))
        from tests.vllm_checkpoints import causal_lm_checkpoint

        causal_lm_checkpoint(args.model_dir, "llama", hidden=args.hidden, layers=args.layers)
    root = args.model_dir.parent / (args.model_dir.name + "-bench")
    daemon = start_daemon(args.model_dir, root / "run")
    try:
        runs = [
            start_once(
                args.model_dir, loader, root / "run" / "daemon-0.sock", root, args.deadline_s
            )
            for _ in range(args.trials)
            for loader in LOADERS
        ]
    finally:
        daemon.terminate()
        daemon.wait(30)
    report = summarize(args, runs)
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)


def summarize(args: argparse.Namespace, runs: list[dict[str, Any]]) -> dict[str, Any]:
    med = {
        loader: {
            k: round(statistics.median(r[k] for r in runs if r["loader"] == loader), 2)
            for k in ("ready_s", *PHASES)
            if all(k in r for r in runs if r["loader"] == loader)
        }
        for loader in LOADERS
    }
    import torch

    ckpt_bytes = sum(p.stat().st_size for p in args.model_dir.glob("*.safetensors"))
    return {
        "bench": "vllm_startup",
        "command": shlex.join([sys.executable, *sys.argv]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {
            "hostname": platform.node(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "load_average": os.getloadavg(),
        },
        "checkpoint": {"hidden": args.hidden, "layers": args.layers, "bytes": ckpt_bytes},
        "runs": runs,
        "median": med,
        "ready_ratio_auto_over_holdfast": round(
            med["auto"]["ready_s"] / med["holdfast"]["ready_s"], 2
        ),
    }


if __name__ == "__main__":
    main()
