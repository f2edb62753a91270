"""vLLM's OpenAI API server, start to ready: `--load-format holdfast` vs vLLM's default loader.

    PYTHONPATH=. python bench/vllm_startup.py --model-dir /tmp/models/vllm-bench \
        --hidden 2048 --layers 4 --trials 2 --out bench/results/vllm-cpu/startup.json

One cache daemon (float32) holds the checkpoint for the whole run, as it does for a warm
standby. Each trial starts the API server once per loader, in turn, from a fresh process to
its first 200 on /health, and stops it. The checkpoint stays in the page cache (the default
loader's best case: no disk read). The servers get the environment the supervisor gives a
CPU engine (supervisor/kinds/vllm.py: one OMP thread, no binding, the worker inside
EngineCore), and run unbuffered, so each output line is stamped with the time it arrived:
`timeline` gives the seconds from start to vLLM's first log line (the API server's
imports), to its EngineCore's first line (config, the EngineCore spawn and its imports), to
"Starting to load model", to "init engine ... took" and to the API server's routes.
`load_model_s` is load_model whole (build, weights, process_weights_after_loading): from
"Starting to load model" to where init engine's clock starts. `import_s` times a bare
`import vllm.entrypoints.openai.api_server` in the venv, once per trial: what a process that
has imported vLLM already (a fork server) would save of the API server's start. The memory
of each server's process tree (Rss, Pss, shared; per process: the pool mapping, anonymous,
files) is read from /proc when it is ready, and the daemon's at the end. Each start's output
is kept in <model-dir>-bench/<loader>-<time>.log.
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
# seconds vLLM (or the plugin) logs for a phase. vLLM's CPU model runner logs no "Model
# loading took": the default loader's "Loading weights took" is the read of the checkpoint
# into the model (not process_weights_after_loading); the plugin's "weights attached ...
# ms=" is its whole load_model (attach, build on meta, place, load the fused parameters,
# process_weights_after_loading)
PHASES = {
    "loading_weights_s": re.compile(r"Loading weights took ([\d.]+) seconds"),
    "holdfast_load_model_s": re.compile(r"weights attached .*ms=([\d.]+)"),
    "init_engine_s": re.compile(
        r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s"
    ),
}
SCALE = {"holdfast_load_model_s": 1e-3}  # logged in ms
# the first line that matches each, in arrival order: seconds from the server's start
MILESTONES = {
    "first_log_s": re.compile(r"(INFO|WARNING|DEBUG)"),
    "engine_core_first_log_s": re.compile(r"EngineCore"),
    "load_model_start_s": re.compile(r"Starting to load model"),
    "engine_initialised_s": PHASES["init_engine_s"],
    "api_server_up_s": re.compile(
        r"Starting vLLM (API|server)|Uvicorn running|Application startup complete"
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
        # as supervisor/kinds/vllm.py sets for a CPU engine
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",  # each line stamped when it is written
    )
    env.pop("HOLDFAST_DAEMONS", None)
    return env


def server_argv(model: Path, port: int, loader: str, sock: Path) -> list[str]:
    argv = [str(VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server"]
    argv += ["--model", str(model), "--dtype", "float32", "--port", str(port)]
    argv += ["--host", "127.0.0.1", "--enforce-eager", "--max-model-len", "256"]
    argv += ["--max-num-seqs", "4", "--distributed-executor-backend", "uni"]
    if loader == "holdfast":
        extra = {
            "sockets": [str(sock)],
            "fallback": False,
            "mode": "zero_copy",
            "layout": "reference",
        }
        argv += ["--load-format", "holdfast", "--model-loader-extra-config", json.dumps(extra)]
    return argv


def tree_memory(pid: int) -> dict[str, Any]:
    """Rss, Pss and shared MiB summed over pid and its descendants, and per process: its
    Rss in the daemon's pool mapping (memfd:holdfast-pool, shared with every engine
    attached), in anonymous memory (private: repacked weights, KV cache, heaps) and in
    files (libraries, the checkpoint when read from the page cache)."""
    pids, i = [pid], 0
    while i < len(pids):
        for task in Path(f"/proc/{pids[i]}/task").glob("*/children"):
            pids += [int(c) for c in task.read_text().split()]
        i += 1
    keys = ("rss_mb", "pss_mb", "shared_mb", "pool_rss_mb", "anon_rss_mb", "file_rss_mb")
    total: dict[str, Any] = dict.fromkeys(keys, 0.0)
    per: list[dict[str, Any]] = []
    for p in pids:
        one = dict.fromkeys(keys, 0.0)
        kind = "anon"
        for line in Path(f"/proc/{p}/smaps").read_text().splitlines():
            head = line.split()
            if head and not head[0].endswith(":"):  # a mapping's header line
                path = head[5] if len(head) > 5 else ""
                kind = (
                    "pool"
                    if "holdfast-pool" in path
                    else "file"
                    if path.startswith("/")
                    else "anon"
                )
                continue
            if len(head) < 2 or not head[1].isdigit():
                continue
            mb = int(head[1]) / 1024
            if head[0] == "Rss:":
                one["rss_mb"] += mb
                one[f"{kind}_rss_mb"] += mb
            elif head[0] == "Pss:":
                one["pss_mb"] += mb
            elif head[0] in ("Shared_Clean:", "Shared_Dirty:"):
                one["shared_mb"] += mb
        comm = Path(f"/proc/{p}/comm").read_text().strip()
        per.append({"pid": p, "comm": comm, **{k: round(v, 1) for k, v in one.items()}})
        for k in keys:
            total[k] += one[k]
    return {**{k: round(v, 1) for k, v in total.items()}, "processes": per}


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
    stamps: list[float] = []

    def pump_lines() -> None:
        for line in proc.stdout or []:
            stamps.append(time.perf_counter() - t0)
            lines.append(line)

    pump = threading.Thread(target=pump_lines, daemon=True)
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
    phases = phases_of(text)
    if loader == "holdfast" and "weights attached" not in text:
        raise SystemExit(f"the holdfast start did not attach:\n{text[-3000:]}")
    timeline = timeline_of(stamps, lines)
    if (load_model := load_model_seconds(timeline, phases)) is not None:
        phases["load_model_s"] = load_model
    log_path = root / f"{loader}-{int(time.time())}.log"
    log_path.write_text(text)
    attached = next((line.strip() for line in lines if "weights attached" in line), None)
    return {
        "loader": loader,
        "ready_s": round(ready_s, 2),
        **phases,
        "timeline": timeline,
        "attached_line": attached,
        "log": str(log_path),
        "memory": memory,
    }


def phases_of(text: str, patterns: dict[str, re.Pattern[str]] | None = None) -> dict[str, float]:
    """The seconds each of `patterns` (default PHASES) finds logged in `text`."""
    return {
        k: round(float(m.group(1)) * SCALE.get(k, 1.0), 3)
        for k, rx in (PHASES if patterns is None else patterns).items()
        if (m := rx.search(text))
    }


def timeline_of(stamps: list[float], lines: list[str]) -> dict[str, float]:
    """Seconds from the start to the first line of each of MILESTONES (-1: none)."""
    return {
        k: round(
            next((t for t, line in zip(stamps, lines, strict=False) if rx.search(line)), -1.0), 2
        )
        for k, rx in MILESTONES.items()
    }


def load_model_seconds(timeline: dict[str, float], phases: dict[str, float]) -> float | None:
    """load_model whole: it ends where init engine's clock starts (that line's arrival less
    its time); None when either line is missing."""
    if min(timeline["load_model_start_s"], timeline["engine_initialised_s"]) < 0:
        return None
    load_end = timeline["engine_initialised_s"] - phases.get("init_engine_s", 0.0)
    return round(load_end - timeline["load_model_start_s"], 2)


def import_seconds(root: Path) -> float:
    """A bare `import vllm.entrypoints.openai.api_server` in the venv, interpreter included."""
    t0 = time.perf_counter()
    argv = [str(VENV / "bin" / "python"), "-c", "import vllm.entrypoints.openai.api_server"]
    subprocess.run(argv, check=True, env=vllm_env(root), capture_output=True)
    return round(time.perf_counter() - t0, 2)


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
            # its log goes on (an attach is a line): drained, so the pipe never fills
            threading.Thread(target=lambda: [*(proc.stderr or [])], daemon=True).start()
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
    runs: list[dict[str, Any]] = []
    imports: list[float] = []
    try:
        for _ in range(args.trials):
            imports.append(import_seconds(root))
            for loader in LOADERS:
                sock = root / "run" / "daemon-0.sock"
                runs.append(start_once(args.model_dir, loader, sock, root, args.deadline_s))
        daemon_memory = tree_memory(daemon.pid)
    finally:
        daemon.terminate()
        daemon.wait(30)
    report = summarize(args, runs, imports)
    report["daemon_memory"] = daemon_memory
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)


def summarize(
    args: argparse.Namespace, runs: list[dict[str, Any]], imports: list[float]
) -> dict[str, Any]:
    med = {
        loader: {
            k: round(statistics.median(r[k] for r in runs if r["loader"] == loader), 2)
            for k in ("ready_s", "load_model_s", *PHASES)
            if all(k in r for r in runs if r["loader"] == loader)
        }
        for loader in LOADERS
    }
    import torch

    ckpt_bytes = sum(p.stat().st_size for p in args.model_dir.glob("*.safetensors"))
    return {
        "bench": "vllm_startup",
        "command": shlex.join([sys.executable, *sys.argv]),
        "commit": subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
        ).stdout.strip(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {
            "hostname": platform.node(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "load_average": os.getloadavg(),
        },
        "checkpoint": {"hidden": args.hidden, "layers": args.layers, "bytes": ckpt_bytes},
        "import_s": imports,
        "runs": runs,
        "median": med,
        "ready_ratio_auto_over_holdfast": round(
            med["auto"]["ready_s"] / med["holdfast"]["ready_s"], 2
        ),
    }


if __name__ == "__main__":
    main()
