"""GPU weight-cache benchmark: cold/warm safetensors loads, raw reads, the daemon's cold load,
client attach, and a daemon restart that reclaims its pool from the keeper.

    PYTHONPATH=. python bench/cuda_load_bench.py --out bench/results/h200_load.json

Checkpoints come from `cachedaemon make-checkpoint` (llama-8b and moe presets) under
--models (made if missing, timed). The page cache is dropped before every cold figure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from bench.cuda_attach import attach_runs
from bench.cuda_procs import Proc, drop_caches, env, log_ts, stamp

PIECE = 64 << 20


def make_models(root: Path, presets: list[str]) -> dict[str, Any]:
    """Generate missing checkpoints, in parallel processes; seconds per preset."""
    procs = {}
    for preset in presets:
        if not (root / preset / "config.json").exists():
            cmd = [
                sys.executable,
                "-m",
                "cachedaemon",
                "make-checkpoint",
                str(root / preset),
                "--preset",
                preset,
            ]
            procs[preset] = (
                time.perf_counter(),
                subprocess.Popen(cmd, env=env(), stdout=subprocess.DEVNULL),
            )
    out = {}
    for preset, (t0, p) in procs.items():
        if p.wait() != 0:
            raise SystemExit(f"make-checkpoint --preset {preset} failed")
        out[preset] = round(time.perf_counter() - t0, 2)
    return out


def files_of(model: Path) -> list[Path]:
    return sorted(model.glob("*.safetensors"))


def raw_read(files: list[Path], threads: int) -> dict[str, float]:
    """Read every byte of the files with 64 MiB preads on `threads` threads."""
    jobs = [(f, off) for f in files for off in range(0, f.stat().st_size, PIECE)]
    fds = {f: os.open(f, os.O_RDONLY) for f in files}
    local = threading.local()

    def read(job: tuple[Path, int]) -> int:
        if not hasattr(local, "buf"):
            local.buf = bytearray(PIECE)
        return os.preadv(fds[job[0]], [local.buf], job[1])

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        total = sum(ex.map(read, jobs))
    secs = time.perf_counter() - t0
    for fd in fds.values():
        os.close(fd)
    return {"threads": threads, "seconds": round(secs, 3), "gb_per_s": round(total / secs / 1e9, 3)}


def safetensors_load(files: list[Path]) -> float:
    from safetensors.torch import load_file

    t0 = time.perf_counter()
    loaded = [load_file(str(f), device="cuda:0") for f in files]
    torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    del loaded
    torch.cuda.empty_cache()
    return round(secs, 3)


def serve(model: Path, run: Path, keeper: Path, verify: str = "before") -> Proc:
    return Proc(
        "serve",
        "--model",
        str(model),
        "--device",
        "cuda:0",
        "--runtime-dir",
        str(run),
        "--keeper",
        str(keeper),
        "--verify",
        verify,
    )


def daemon_figures(d: Proc, nbytes: int) -> dict[str, Any]:
    serving = d.wait_for("serving", 600)
    ready = d.event("pool ready") or {}
    secs = float(ready.get("seconds", 0.0))
    return {
        "spawn_to_serving_s": round(d.since_start(serving), 3),
        "pool_ready_s": secs,
        "pool_ready_to_serving_ms": round((log_ts(serving) - log_ts(ready)) * 1e3, 3),
        "adopted": ready.get("adopted"),
        "checkpoint_bytes_read": ready.get("checkpoint_bytes_read"),
        "gb_per_s": round(nbytes / secs / 1e9, 3) if secs and not ready.get("adopted") else None,
    }


def bench_model(name: str, model: Path, run: Path, baselines: bool) -> dict[str, Any]:
    files = files_of(model)
    nbytes = sum(f.stat().st_size for f in files)
    r: dict[str, Any] = {
        "model": name,
        "file_bytes": nbytes,
        "files": len(files),
        "cache_drop": drop_caches(files),
    }
    if baselines:
        r["raw_read_sequential"] = raw_read(files, 1)
        drop_caches(files)
        r["raw_read_parallel"] = raw_read(files, 8)
        drop_caches(files)
        r["safetensors_cold_s"] = safetensors_load(files)
        r["safetensors_warm_s"] = safetensors_load(files)
        print(json.dumps(r), flush=True)
    ksock = run / "keeper.sock"
    keeper = Proc("keeper", "--socket", str(ksock))
    keeper.wait_for("keeper serving", 60)
    try:
        drop_caches(files)
        d = serve(model, run, ksock)
        r["daemon_cold"] = daemon_figures(d, nbytes)
        fingerprint = str(d.wait_for("serving")["fingerprint"])
        r["attach"] = attach_runs(run / "daemon-0.sock")
        d.kill()
        # reclaim, serve at once, verify the checksums in the background
        d = serve(model, run, ksock, "background")
        r["daemon_restart"] = daemon_figures(d, nbytes)
        r["attach_after_restart"] = attach_runs(run / "daemon-0.sock")
        verified = d.wait_for("reclaimed pool verified", 120)
        r["daemon_restart"]["background_verify_ms"] = verified.get("ms")
        d.kill()
        # reclaim, verify every checksum, then serve
        d = serve(model, run, ksock, "before")
        r["daemon_restart_verify_before"] = daemon_figures(d, nbytes)
        d.stop()
        r["fingerprint"] = fingerprint
    finally:
        keeper.stop()
    print(json.dumps(r), flush=True)
    return r


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="JSON results file")
    parser.add_argument("--models", type=Path, default=Path("/tmp/models"), help="checkpoint dirs")
    parser.add_argument(
        "--only", choices=["llama-8b", "moe"], action="append", help="presets to run"
    )
    parser.add_argument(
        "--no-baselines", action="store_true", help="skip raw and safetensors reads"
    )
    args = parser.parse_args()
    presets = args.only or ["moe", "llama-8b"]
    result: dict[str, Any] = {
        **stamp(sys.argv),
        "make_checkpoint_s": make_models(args.models, presets),
    }
    print(json.dumps(result), flush=True)
    for name in presets:
        run = Path(f"/tmp/holdfast-run-{name}")
        result[name] = bench_model(name, args.models / name, run, not args.no_baselines)
        args.out.write_text(json.dumps(result, indent=2))
    result["bars"] = bars(result)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result["bars"], indent=2))


def bars(res: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, limit in (("llama-8b", 10.0), ("moe", 25.0)):
        r = res.get(name)
        if not r or "median_ms" not in r.get("attach", {}) or "safetensors_cold_s" not in r:
            continue
        attach = r["attach"]["median_ms"]
        cold = r["safetensors_cold_s"] * 1e3
        load = r["daemon_cold"]
        out[name] = {
            f"attach_ms<={limit}": [attach, attach <= limit],
            "attach_speedup_vs_cold_safetensors>=500": [
                round(cold / attach, 1),
                cold / attach >= 500,
            ],
            "daemon_cold_gbps/raw_seq_gbps>=0.8": [
                round(load["gb_per_s"] / r["raw_read_sequential"]["gb_per_s"], 3),
                load["gb_per_s"] >= 0.8 * r["raw_read_sequential"]["gb_per_s"],
            ],
            "reclaim_and_serve_ms<100": [
                round(
                    r["daemon_restart"]["pool_ready_s"] * 1e3
                    + r["daemon_restart"]["pool_ready_to_serving_ms"],
                    3,
                ),
                r["daemon_restart"]["pool_ready_s"] * 1e3
                + r["daemon_restart"]["pool_ready_to_serving_ms"]
                < 100,
            ],
        }
    return out


if __name__ == "__main__":
    main()
