"""Client attach timed in a fresh process (context warmed first): `attach_state_dict`
as it is, and the same attach with one `as_strided` per tensor over typed chunk views.

Used by bench/cuda_load_bench.py; `python bench/cuda_attach.py SOCKET` runs it alone.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.cuda_procs import env

ATTACH = r"""
import gc, json, statistics, sys, time, torch
from cachedaemon import protocol
from holdfast_contract import wire
from cachedaemon.backends import get_backend
from cachedaemon.loader import dtype_of
t0 = time.perf_counter(); torch.zeros(1, device="cuda:0"); torch.cuda.synchronize()
ctx_ms = (time.perf_counter() - t0) * 1e3
from cachedaemon.client import attach_state_dict

def one_op_views(sock):
    # connect + manifest, import + map, then one as_strided per tensor over typed chunk views
    t0 = time.perf_counter()
    reply, fds = protocol.call(sock, protocol.AttachRequest(None), max_fds=wire.MAX_FDS)
    m = reply.manifest
    t1 = time.perf_counter()
    backend = get_backend(m.backend, m.device)
    maps = [backend.open(fd, c.size) for fd, c in zip(fds, m.chunks)]
    wire.close_fds(fds)
    t2 = time.perf_counter()
    typed, out = {}, {}
    for e in m.tensors:
        t = typed.get((e.chunk, e.dtype))
        if t is None:
            t = typed[(e.chunk, e.dtype)] = maps[e.chunk].tensor.view(dtype_of(e.dtype))
        out[e.name] = t.as_strided(e.shape, e.stride, e.offset // t.element_size())
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    return out, [(t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3, (t3 - t0) * 1e3]

runs, fast, n = [], [], 0
for _ in range(12):
    t0 = time.perf_counter()
    sd = attach_state_dict(sys.argv[1])
    torch.cuda.synchronize()
    runs.append((time.perf_counter() - t0) * 1e3)
    n = len(sd); del sd; gc.collect()
for _ in range(12):
    sd, parts = one_op_views(sys.argv[1])
    fast.append(parts)
    del sd; gc.collect()
med = [round(statistics.median(p[i] for p in fast[1:]), 3) for i in range(4)]
print(json.dumps({"context_ms": ctx_ms, "tensors": n, "runs_ms": runs,
                  "one_op_views_ms": dict(zip(["call", "map", "views", "total"], med))}))
"""


def attach_runs(sock: Path) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", ATTACH, str(sock)],
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if proc.returncode:
        return {"error": proc.stderr[-3000:]}
    res: dict[str, Any] = json.loads(proc.stdout.splitlines()[-1])
    res["first_ms"] = round(res["runs_ms"][0], 3)
    res["median_ms"] = round(statistics.median(res["runs_ms"][1:]), 3)
    return res


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(
        description="Time client attach to a serving daemon, e.g.\n"
        "  PYTHONPATH=. python bench/cuda_attach.py /tmp/run/daemon-0.sock",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("socket", type=Path, help="the daemon's socket")
    print(json.dumps(attach_runs(parser.parse_args().socket), indent=2))
