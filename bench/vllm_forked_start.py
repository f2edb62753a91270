"""What a fork server would give a vLLM standby: start to ready of an API server forked from
a process that has imported vLLM already, against plain starts (holdfast and the default
loader) in the same run.

    PYTHONPATH=. python3 bench/vllm_forked_start.py --model-dir /tmp/models/vllm-bench-4096 \
        --trials 2 --out bench/results/vllm-cpu/forked_start_h4096.json

A prototype of the measurement, not of a product: one process in the vLLM venv imports
`vllm.entrypoints.launchers.api_server.entry` (what `python -m
vllm.entrypoints.openai.api_server` runs) and then forks, on each request, a child that runs
its `main()` with `--load-format holdfast`. Its clock starts when the request is written.
The EngineCore is still spawned by vLLM (its CPU platform forces spawn), so it imports vLLM
again. The daemon, the flags, the environment and the checkpoint are those of
bench/vllm_startup.py (the checkpoint must exist: that bench makes it).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
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

FORKER = r"""
import json, os, sys
from vllm.entrypoints.launchers.api_server.entry import main
print("imported", flush=True)
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        os.setsid()
        fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.argv = req["argv"]
        code = 0
        try:
            main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    print(pid, flush=True)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[-1][0] != "Z"


def forked_start(
    forker: subprocess.Popen[str], model: Path, sock: Path, root: Path, deadline_s: float
) -> dict[str, Any]:
    port = vs.free_port()
    argv = vs.server_argv(model, port, "holdfast", sock)[2:]  # after `python -m`
    log = root / f"forked-{int(time.time())}.log"
    assert forker.stdin is not None and forker.stdout is not None
    t0 = time.perf_counter()
    forker.stdin.write(json.dumps({"argv": argv, "log": str(log)}) + "\n")
    forker.stdin.flush()
    pid = int(forker.stdout.readline())
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
    text = log.read_text()
    if ready_s is None:
        raise SystemExit(f"the forked vLLM was not ready:\n{text[-3000:]}")
    if "weights attached" not in text:
        raise SystemExit(f"the forked start did not attach:\n{text[-3000:]}")
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
    argv = [str(vs.VENV / "bin" / "python"), "-c", FORKER]
    t0 = time.perf_counter()
    forker = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=vs.vllm_env(root),
        start_new_session=True,
    )
    runs: list[dict[str, Any]] = []
    try:
        assert forker.stdout is not None
        if forker.stdout.readline().strip() != "imported":
            raise SystemExit(f"the forker exited with {forker.wait()} before it imported vLLM")
        forker_import_s = round(time.perf_counter() - t0, 2)
        for _ in range(args.trials):
            runs.append(forked_start(forker, args.model_dir, sock, root, args.deadline_s))
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
