"""Attach time against a safetensors load of the same checkpoint, on this machine.

    python bench/attach.py --presets tiny small --repeats 20 --out bench/results/attach_cpu.json

For each preset: generate the checkpoint (once, under --models), start a real
`cachedaemon serve`, then time in this process (median of repeats):
  - attach: connect, manifest + fds, map every chunk, build every tensor view;
  - safetensors: `safetensors.torch.load_file` of the same files (page cache warm; it
    maps the file, so pages are read later, on first touch);
  - disk read load: `cachedaemon.loader.load_state_dict`, every byte read into memory;
  - daemon load: the daemon's own disk-to-pool time, from its log.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from cachedaemon.checkpoint import safetensors_files  # noqa: E402
from cachedaemon.checkpoint_gen import make_checkpoint  # noqa: E402
from cachedaemon.client import attach  # noqa: E402
from cachedaemon.loader import load_state_dict  # noqa: E402


def start_daemon(model: Path, run: Path) -> tuple[subprocess.Popen[str], dict[str, float]]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cachedaemon",
            "--log-format",
            "json",
            "serve",
            "--model",
            str(model),
            "--runtime-dir",
            str(run),
        ],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    info: dict[str, float] = {}
    assert proc.stderr is not None
    for line in proc.stderr:
        ev = json.loads(line) if line.startswith("{") else {}
        if ev.get("event") == "pool ready":
            info["daemon_load_s"] = ev["seconds"]
        if ev.get("event") == "serving":
            return proc, info
    raise RuntimeError(f"daemon exited {proc.wait()}")


def bench_preset(preset: str, models: Path, repeats: int) -> dict[str, object]:
    from safetensors.torch import load_file

    model = models / preset
    if not (model / "config.json").exists():
        make_checkpoint(model, preset)
    files = safetensors_files(model)
    with tempfile.TemporaryDirectory() as run:
        proc, info = start_daemon(model, Path(run))
        try:
            sock = Path(run) / "daemon-0.sock"
            attach_ms, n_tensors, pool_bytes = [], 0, 0
            for _ in range(repeats):
                t0 = time.perf_counter()
                got = attach(sock)
                attach_ms.append((time.perf_counter() - t0) * 1e3)
                n_tensors = len(got.tensors)
                pool_bytes = sum(m.size for m in got.mappings)
                del got
            load_ms, read_ms = [], []
            for _ in range(max(3, repeats // 5)):
                t0 = time.perf_counter()
                state = {k: v for f in files for k, v in load_file(f).items()}
                load_ms.append((time.perf_counter() - t0) * 1e3)
                del state
                t0 = time.perf_counter()
                state = load_state_dict(model)  # every byte read into process memory
                read_ms.append((time.perf_counter() - t0) * 1e3)
                del state
        finally:
            proc.terminate()
            proc.wait()
    attach_med, load_med = statistics.median(attach_ms), statistics.median(load_ms)
    return {
        "preset": preset,
        "tensors": n_tensors,
        "pool_bytes": pool_bytes,
        "attach_ms_median": round(attach_med, 3),
        "attach_ms_max": round(max(attach_ms), 3),
        "safetensors_load_file_ms_median": round(load_med, 1),
        "disk_read_load_ms_median": round(statistics.median(read_ms), 1),
        "daemon_load_s": info.get("daemon_load_s"),
        "speedup_vs_load_file": round(load_med / attach_med, 1),
        "speedup_vs_disk_read_load": round(statistics.median(read_ms) / attach_med, 1),
        "repeats": repeats,
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--presets", nargs="+", default=["tiny", "small"])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()) / "holdfast-models")
    p.add_argument("--bar-ms", type=float, default=20.0, help="attach bar for the small preset")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    rows = [bench_preset(preset, args.models, args.repeats) for preset in args.presets]
    small = next((r for r in rows if r["preset"] == "small"), None)
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
        "results": rows,
        "bar": f"small attach median < {args.bar_ms} ms",
        "bar_passed": bool(small and float(small["attach_ms_median"]) < args.bar_ms),  # type: ignore[arg-type]
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
