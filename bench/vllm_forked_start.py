"""A vLLM standby started as the supervisor starts it: start to ready of an API server
forked from `holdfast_vllm.forkserver` (vLLM imported once) that forks its EngineCore in
turn (HOLDFAST_VLLM_FORK=1), against plain starts (holdfast and the default loader) in the
same run.

    PYTHONPATH=. python3 bench/vllm_forked_start.py --model-dir /tmp/models/vllm-bench-4096 \
        --trials 2 --out bench/results/vllm-cpu/forked_start_h4096.json

The fork server runs in the vLLM venv, and each forked start is one request of
`holdfast_contract.forkserver` (what supervisor/procs.py sends), its clock started when
the request is sent. The daemon, the flags, the environment and the checkpoint are those
of bench/vllm_startup.py (the checkpoint must exist: that bench makes it).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_startup as vs  # noqa: E402

from holdfast_contract import forkserver  # noqa: E402
from supervisor.kinds.vllm import FORK_ENV  # noqa: E402


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[-1][0] != "Z"


def forked_start(
    server: Path, model: Path, sock: Path, root: Path, deadline_s: float
) -> dict[str, Any]:
    port = vs.free_port()
    argv = vs.server_argv(model, port, "holdfast", sock)[3:]  # after `python -m MODULE`
    log = root / f"forked-{int(time.time())}.log"
    env = {**vs.vllm_env(root), FORK_ENV: "1"}
    spawn = forkserver.Spawn(argv=argv, env=env, cwd=str(root), owner=os.getpid())
    with open(log, "wb") as out, open(os.devnull, "rb") as null:
        t0 = time.perf_counter()
        conn, pid = forkserver.request(server, spawn, [null.fileno(), out.fileno(), out.fileno()])
    url = f"http://127.0.0.1:{port}/health"
    ready_s = None
    try:
        while time.perf_counter() - t0 < deadline_s and alive(pid):
            try:
                with urllib.request.urlopen(url, timeout=1) as r:
                    if r.status == 200:
                        ready_s = time.perf_counter() - t0
                        break
            except OSError:
                time.sleep(0.05)  # vLLM signals readiness only through HTTP
        memory = vs.tree_memory(pid) if ready_s is not None else {}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
        end = time.monotonic() + 30
        while alive(pid) and time.monotonic() < end:
            time.sleep(0.1)
        if alive(pid):
            os.killpg(pid, signal.SIGKILL)
    conn.close()
    text = log.read_text()
    if ready_s is None:
        raise SystemExit(f"the forked vLLM was not ready:\n{text[-3000:]}")
    if "weights attached" not in text or not re.search(r'engine_core("?: "|=)forked', text):
        raise SystemExit(f"the forked start did not attach in a forked EngineCore:\n{text[-3000:]}")
    return {
        "loader": "holdfast-forked",
        "ready_s": round(ready_s, 2),
        "log": str(log),
        "rss_mb": memory.get("rss_mb"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--deadline-s", type=float, default=900.0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if not (args.model_dir / "config.json").is_file():
        raise SystemExit(f"{args.model_dir} has no checkpoint: run bench/vllm_startup.py first")
    root = args.model_dir.parent / (args.model_dir.name + "-bench")
    sock = root / "run" / "daemon-0.sock"
    daemon = vs.start_daemon(args.model_dir, root / "run")
    server = root / "run" / "vllm-forkserver.sock"
    server.unlink(missing_ok=True)  # an earlier run's, killed
    argv = [str(vs.VENV / "bin" / "python"), "-m", "holdfast_vllm.forkserver"]
    argv += ["--socket", str(server)]
    t0 = time.perf_counter()
    forker = subprocess.Popen(
        argv, env={**vs.vllm_env(root), FORK_ENV: "1"}, start_new_session=True
    )
    runs: list[dict[str, Any]] = []
    try:
        while not server.exists():
            if forker.poll() is not None:
                raise SystemExit(f"the vLLM fork server exited with {forker.returncode}")
            time.sleep(0.1)
        forker_import_s = round(time.perf_counter() - t0, 2)
        for _ in range(args.trials):
            runs.append(forked_start(server, args.model_dir, sock, root, args.deadline_s))
            for loader in vs.LOADERS:
                runs.append(vs.start_once(args.model_dir, loader, sock, root, args.deadline_s))
    finally:
        os.killpg(forker.pid, signal.SIGKILL)
        forker.wait()
        daemon.terminate()
        daemon.wait(30)
    kinds = ("holdfast-forked", *vs.LOADERS)
    med = {k: statistics.median(r["ready_s"] for r in runs if r["loader"] == k) for k in kinds}
    report = {
        "bench": "vllm_forked_start",
        "command": shlex.join([sys.executable, *sys.argv]),
        "commit": subprocess.run(
            ["git", "-C", str(vs.REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
        ).stdout.strip(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {
            "hostname": platform.node(),
            "cpus": os.cpu_count(),
            "load_average": os.getloadavg(),
        },
        "checkpoint_bytes": sum(p.stat().st_size for p in args.model_dir.glob("*.safetensors")),
        "forker_import_s": forker_import_s,
        "runs": runs,
        "median_ready_s": med,
        "ready_ratio_auto_over_forked": round(med["auto"] / med["holdfast-forked"], 2),
    }
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
