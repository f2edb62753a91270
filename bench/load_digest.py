"""The daemon's load time: `build_pool` of a checkpoint into a fresh pool.

    PYTHONPATH=. python bench/load_digest.py --preset small --label after \\
        --out bench/results/load_digest/cpu_after.json
    PYTHONPATH=. python bench/load_digest.py --preset llama-8b --device cuda:0 --label after \\
        --out bench/results/load_digest/h200_after.json

The checkpoint comes from `cachedaemon make-checkpoint --preset` under --models (made if
missing). Each run builds the pool as `cachedaemon serve` does (same reader, same filler,
the content digest of every file included where the code computes one) and closes it;
the median of --runs is the figure (wall seconds, and CPU seconds of all the process's
threads: the cost on a machine whose other cores are busy). The page cache stays warm
(the load's own work: copy, checksum, digest), or with --cold the checkpoint's pages are
evicted before each load (a daemon's first start after the files were written or the
machine booted: the disk's speed shows).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def ensure_checkpoint(models: Path, preset: str) -> Path:
    out = models / preset
    if not (out / "config.json").exists():
        cmd = [sys.executable, "-m", "cachedaemon", "make-checkpoint", str(out), "--preset", preset]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return out


def machine() -> dict[str, Any]:
    cpu = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "load_avg_at_start": os.getloadavg(),
        "python": platform.python_version(),
    }


def evict(model: Path) -> None:
    """Drop this checkpoint's pages from the page cache (its files only: nothing else on
    the machine is touched), so that the load reads the disk."""
    for path in model.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def one_load(model: Path, device: str, cold: bool = False, digest: bool = True) -> dict[str, Any]:
    from cachedaemon.backends import get_backend
    from cachedaemon.config import LoadOptions, config_for
    from cachedaemon.pool import build_pool

    opts = LoadOptions(dtype="bfloat16", device=device)
    config = config_for(model, opts)
    backend = get_backend(config.backend, device)
    if cold:
        evict(model)
    t0, c0 = time.perf_counter(), time.process_time()
    pool, nbytes = build_pool(model, opts, backend, config.fingerprint(), digest=digest)
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    files = pool.manifest.files
    pool.close()
    out: dict[str, Any] = {
        "seconds": seconds,
        "cpu_seconds": cpu,
        "gb_per_s": nbytes / seconds / 1e9,
    }
    if digest:  # the load's digest against the files read again on the CPU (digest_dir)
        from cachedaemon.digest import differences, digest_dir

        out["digest_differences"] = differences(files, digest_dir(model))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--models", default="/tmp/holdfast-bench-models")
    p.add_argument("--device", default="cpu", help="cpu or cuda:N")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--label", default="", help="what code this is (before, after, ...)")
    p.add_argument(
        "--cold", action="store_true", help="evict the checkpoint's pages before each load"
    )
    p.add_argument(
        "--compare",
        action="store_true",
        help="interleave loads without the content digest (the baseline) with loads with it, "
        "--runs of each, in this one process: both figures from one run on one machine",
    )
    p.add_argument(
        "--workers", type=int, default=0, help="digest threads (default: the daemon's own)"
    )
    p.add_argument(
        "--readers",
        type=int,
        default=0,
        help="GPU load: reader threads, with and without the digest (default: the "
        "daemon's own, cuda_load.WORKERS)",
    )
    p.add_argument("--out", help="write the result as JSON here")
    args = p.parse_args()
    from cachedaemon import digest

    if args.workers:
        digest.WORKERS = args.workers
    readers, hashed_on = 0, "cpu"
    if args.device.startswith("cuda"):
        import torch

        from cachedaemon import cuda_load

        if args.readers:
            cuda_load.WORKERS = args.readers
        readers = cuda_load.WORKERS
        # the GPU's BLAKE3, or the readers where it is missing or disagrees with the CPU's
        gpu = cuda_load.gpu_hashing(torch.device(args.device))
        hashed_on = "gpu (blake3_gpu)" if gpu else "cpu (the GPU load's readers)"
    model = ensure_checkpoint(Path(args.models), args.preset)
    one_load(model, args.device)  # warm the page cache and the imports
    baseline: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    for _ in range(args.runs):
        if args.compare:
            baseline.append(one_load(model, args.device, args.cold, digest=False))
        runs.append(one_load(model, args.device, args.cold))
    seconds = [r["seconds"] for r in runs]
    differ = sorted({d for r in runs for d in r.pop("digest_differences")})
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": commit,
        "label": args.label,
        "machine": machine(),
        "digest_workers": digest.WORKERS,
        "gpu_readers": readers,
        "digest_hashed_on": hashed_on,
        "preset": args.preset,
        "device": args.device,
        "page_cache": "evicted before each load" if args.cold else "warm",
        "checkpoint_bytes": sum(f.stat().st_size for f in model.glob("*.safetensors")),
        "seconds": [round(s, 3) for s in seconds],
        "median_s": round(statistics.median(seconds), 3),
        "cpu_seconds": [round(r["cpu_seconds"], 3) for r in runs],
        "median_cpu_s": round(statistics.median(r["cpu_seconds"] for r in runs), 3),
        "median_gb_per_s": round(statistics.median(r["gb_per_s"] for r in runs), 3),
        # every load's digest equal to the CPU's of the files (cachedaemon verify's)
        "digest_equal_to_cpu": not differ,
        "digest_differences": differ,
    }
    if baseline:
        base = [r["seconds"] for r in baseline]
        result["without_digest"] = {
            "seconds": [round(s, 3) for s in base],
            "median_s": round(statistics.median(base), 3),
            "median_cpu_s": round(statistics.median(r["cpu_seconds"] for r in baseline), 3),
        }
        result["with_over_without"] = round(result["median_s"] / statistics.median(base), 3)
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
