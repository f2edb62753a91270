"""Measure the cuda-vmm backend alone: attach cost by chunk layout, checksum throughput,
whether a sealed owner mapping really becomes read-only.

    PYTHONPATH=. python bench/cuda_vmm_probe.py --out /tmp/probe.json

The parent creates pools of the same total size cut into 1, 4, 16 and 64 chunks; a fresh
child process (context warmed first) imports, maps and wraps every chunk as a tensor, then
cuts 324 or 3000 typed views from them, timed with a host clock after a device sync.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from cachedaemon.backends.cuda_vmm import CudaVmmBackend
from cachedaemon.cuda_checksum import gpu_checksum

GiB = 1 << 30
CHILD = r"""
import gc, json, statistics, sys, time, torch
from cachedaemon.backends.cuda_vmm import CudaVmmBackend
fds, size, views = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
t0 = time.perf_counter(); torch.zeros(1, device="cuda:0"); ctx_ms = (time.perf_counter() - t0) * 1e3
b = CudaVmmBackend("cuda:0")
per = (size * len(fds)) // views // 256 * 256
runs = []
for _ in range(7):
    t0 = time.perf_counter()
    maps = [b.open(fd, size) for fd in fds]
    flat = [m.tensor for m in maps]
    out = []
    for i in range(views):
        off = i * per
        c, o = divmod(off, size)
        out.append(flat[c][o:o + per].view(torch.bfloat16).view(-1, 128))
    torch.cuda.synchronize()
    runs.append((time.perf_counter() - t0) * 1e3)
    del out, flat
    for m in maps: m.close()
    gc.collect()
print(json.dumps({"context_ms": ctx_ms, "attach_ms": runs}))
"""


def _attach(fds: list[int], size: int, views: int) -> dict[str, object]:
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(fds), str(size), str(views)],
        pass_fds=fds,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if proc.returncode:
        return {"error": proc.stderr[-2000:]}
    res = json.loads(proc.stdout.splitlines()[-1])
    res["attach_ms_median"] = statistics.median(res["attach_ms"][1:])
    return res


def layouts(backend: CudaVmmBackend, total: int) -> list[dict[str, object]]:
    rows = []
    for count in (1, 4, 16, 64):
        size = total // count
        t0 = time.perf_counter()
        chunks = [backend.create(size) for _ in range(count)]
        create_ms = (time.perf_counter() - t0) * 1e3
        for views in (324, 3000):
            res = _attach([c.fd for c in chunks], chunks[0].size, views)
            rows.append(
                {
                    "chunks": count,
                    "chunk_bytes": size,
                    "views": views,
                    "create_ms": create_ms,
                    **res,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
        for c in chunks:
            c.close()
    return rows


def checksum_rate(backend: CudaVmmBackend, nbytes: int, tensors: int) -> dict[str, float]:
    """One chunk cut into `tensors` equal 256-aligned regions, checksummed in one batch."""
    from cachedaemon.cuda_checksum import gpu_checksums

    chunk = backend.create(nbytes)
    chunk.tensor.view(torch.int32).random_()
    per = chunk.size // tensors // 256 * 256
    regions = [chunk.tensor[i * per : (i + 1) * per - 3] for i in range(tensors)]
    gpu_checksums(regions[:4])
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        gpu_checksums(regions)
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for r in regions[:100]:
        gpu_checksum(r)
    one_by_one_ms = (time.perf_counter() - t0) * 1e3 / 100
    del regions
    chunk.close()
    best = min(times)
    return {
        "bytes": nbytes,
        "tensors": tensors,
        "batched_ms": round(best * 1e3, 3),
        "gb_per_s": round(nbytes / best / 1e9, 1),
        "one_tensor_call_ms": round(one_by_one_ms, 3),
    }


def fp8_parity() -> dict[str, object]:
    """fp8-block scales on GPU vs CPU: as quant.py computes them, and with a tensor divisor."""
    from cachedaemon import quant

    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(4096, 4096, generator=gen) * 0.02).to(torch.bfloat16)
    cq, cs = quant.fp8_block_quantize(w)
    gq, gs = quant.fp8_block_quantize(w.cuda())
    blocks = w.float().view(32, 128, 32, 128).abs().amax(dim=(1, 3))
    out: dict[str, object] = {
        "quant_py_q_equal": bool(torch.equal(cq.view(torch.uint8), gq.cpu().view(torch.uint8))),
        "quant_py_scale_equal": bool(torch.equal(cs, gs.cpu())),
        "scalar_divisor_equal": bool(torch.equal(blocks / 448.0, (blocks.cuda() / 448.0).cpu())),
        "tensor_divisor_equal": bool(
            torch.equal(
                blocks / torch.full_like(blocks, 448.0),
                (blocks.cuda() / torch.full_like(blocks.cuda(), 448.0)).cpu(),
            )
        ),
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--total-gib", type=int, default=16)
    parser.add_argument("--layouts", action="store_true", help="also time attach by chunk layout")
    args = parser.parse_args()
    backend = CudaVmmBackend("cuda:0")
    result = {
        "command": " ".join(sys.argv),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{socket.gethostname()} {torch.cuda.get_device_name(0)}",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "granularity": backend.granularity,
        "fp8_parity": fp8_parity(),
        "checksum": [
            checksum_rate(backend, args.total_gib * GiB, 324),
            checksum_rate(backend, 2 * GiB, 3000),
        ],
        "layouts": layouts(backend, args.total_gib * GiB) if args.layouts else "not run",
    }
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k] for k in ("fp8_parity", "checksum")}, indent=1))


if __name__ == "__main__":
    main()
