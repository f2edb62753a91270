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


def serve(model: Path, run: Path, keeper: Path) -> Proc:
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


def proposed_reclaim(keeper: Path, fingerprint: str) -> dict[str, Any]:
    """Reclaim from the keeper in this process and verify with one batched checksum."""
    from cachedaemon import protocol
    from cachedaemon.backends.cuda_vmm import CudaVmmBackend
    from cachedaemon.pool import Pool

    backend = CudaVmmBackend("cuda:0")
    t0 = time.perf_counter()
    reply, fds = protocol.call(str(keeper), protocol.Reclaim(fingerprint), max_fds=protocol.MAX_FDS)
    assert isinstance(reply, protocol.Reclaimed), reply
    m = reply.manifest
    pool = Pool(m, [backend.open(fd, c.size) for fd, c in zip(fds, m.chunks, strict=True)], fds)
    t_map = time.perf_counter()
    regions = [pool.chunks[e.chunk].tensor[e.offset : e.offset + e.nbytes] for e in m.tensors]
    bad = [
        e.name
        for e, s in zip(m.tensors, backend.checksums(regions), strict=True)
        if s != e.checksum
    ]
    t_sum = time.perf_counter()
    serial_bad = pool.bad_tensors(backend)  # the per-tensor path, for comparison
    t_serial = time.perf_counter()
    del regions
    pool.close()
    return {
        "reclaim_map_ms": round((t_map - t0) * 1e3, 3),
        "batched_verify_ms": round((t_sum - t_map) * 1e3, 3),
        "reclaim_and_verify_ms": round((t_sum - t0) * 1e3, 3),
        "per_tensor_verify_ms": round((t_serial - t_sum) * 1e3, 3),
        "bad": len(bad) + len(serial_bad),
    }


def proposed_cold_load(model: Path, nbytes: int, worker_counts: list[int]) -> dict[str, Any]:
    """The pool built in this process with the parallel GPU fill, page cache dropped."""
    from cachedaemon import cuda_load, pool
    from cachedaemon.backends.cuda_vmm import CudaVmmBackend
    from cachedaemon.loader import LoadOptions

    backend = CudaVmmBackend("cuda:0")
    out: dict[str, Any] = {}
    for workers in worker_counts:
        drop_caches(files_of(model))
        serial_fill = pool._fill
        pool._fill = lambda *a, w=workers: cuda_load.fill_parallel(*a, workers=w)  # type: ignore[assignment]
        try:
            t0 = time.perf_counter()
            built, _ = pool.build_pool(model, LoadOptions(device="cuda:0"), backend, "bench")
            secs = time.perf_counter() - t0
        finally:
            pool._fill = serial_fill
        built.close()
        out[f"workers_{workers}"] = {
            "seconds": round(secs, 3),
            "gb_per_s": round(nbytes / secs / 1e9, 3),
        }
    return out


def bench_model(
    name: str, model: Path, run: Path, baselines: bool, workers: list[int]
) -> dict[str, Any]:
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
        d = serve(model, run, ksock)
        r["daemon_restart"] = daemon_figures(d, nbytes)
        r["attach_after_restart"] = attach_runs(run / "daemon-0.sock")
        r["proposed_reclaim"] = proposed_reclaim(ksock, fingerprint)
        d.stop()
    finally:
        keeper.stop()
    r["proposed_cold_load"] = proposed_cold_load(model, nbytes, workers)
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
    parser.add_argument("--workers", type=int, action="append", help="parallel fill threads (8)")
    args = parser.parse_args()
    presets = args.only or ["moe", "llama-8b"]
    result: dict[str, Any] = {
        **stamp(sys.argv),
        "make_checkpoint_s": make_models(args.models, presets),
    }
    print(json.dumps(result), flush=True)
    for name in presets:
        run = Path(f"/tmp/holdfast-run-{name}")
        result[name] = bench_model(
            name, args.models / name, run, not args.no_baselines, args.workers or [8]
        )
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
