"""Where a CUDA decode step's time goes, kernel by kernel, and how fast each projection
reads its weights.

- `--part gemv`: for each weight shape of the model (and the fused q|k|v and gate|up
  shapes), one row times the weight with cuBLAS (`F.linear`) and with holdfast's one-row
  kernel (engine/gemv.py) at several tilings: microseconds per product and the bytes read
  per second, each product on its own copy of the weight (copies enough to overflow L2),
  replayed from a CUDA graph as a decode step is.
- `--part step`: the model on random weights laid out as a pool lays them (only the preset's
  config is read), per batch size: a decode step through the runner (wall), its graph's
  replay and the eager step (CUDA events), and the GPU time of each kernel name in one eager
  step (torch's profiler), and the step prefilling that batch's 64-token prompts (CUDA
  events); with separate q, k, v, gate and up products, then fused, then
  fused with one-row products on holdfast's kernel.

    PYTHONPATH=. python bench/decode_profile.py --preset llama-8b --out /tmp/decode.json
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.engine_startup import machine  # noqa: E402
from cachedaemon.checkpoint_gen import PRESETS  # noqa: E402
from engine import gemv  # noqa: E402

L2_OVERFLOW = 256 << 20  # bytes of weight copies per timed graph: well past any L2


def graph_us(fn: Any, calls: int, reps: int = 5) -> float:
    """Median microseconds per call of `fn(i)` for i in range(calls), replayed in one graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(calls):  # warm: compiles, and cuBLAS picks its kernels
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(times)


def shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, int]]:
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    return {
        "q_proj/o_proj": (h, h),
        "k_proj/v_proj": (kv, h),
        "qkv fused": (h + 2 * kv, h),
        "gate_proj/up_proj": (inter, h),
        "gate_up fused": (2 * inter, h),
        "down_proj": (h, inter),
        "lm_head": (vocab, h),
    }


TILINGS = [
    gemv.Tiling(bn, bk, w, s)
    for bn in (4, 8, 16, 32)
    for bk in (256, 512, 1024)
    for w in (4, 8)
    for s in (2, 3, 4)
    if bn * bk <= 16384
]


def one_shape(name: str, n: int, k: int, device: torch.device) -> dict[str, Any]:
    nbytes = n * k * 2
    copies = max(2, math.ceil(L2_OVERFLOW / nbytes))
    ws = [torch.randn(n, k, dtype=torch.bfloat16, device=device) * 0.02 for _ in range(copies)]
    x = torch.randn(1, k, dtype=torch.bfloat16, device=device)
    cublas = graph_us(lambda i: F.linear(x, ws[i]), copies)
    best: tuple[float, gemv.Tiling] | None = None
    tried: dict[str, float | str] = {}
    for t in TILINGS:
        if k % t.block_k:
            continue
        try:
            us = graph_us(lambda i, t=t: gemv.gemv(x, ws[i], t), copies, reps=3)
        except Exception as exc:  # a tiling the compiler cannot fit (registers)
            tried[str(tuple(t))] = repr(exc)[:80]
            continue
        tried[str(tuple(t))] = round(us, 2)
        if best is None or us < best[0]:
            best = (us, t)
    default_us = graph_us(lambda i: gemv.gemv(x, ws[i]), copies)
    diff = (gemv.gemv(x, ws[0]).float() - F.linear(x, ws[0]).float()).abs().max().item()
    return {
        "weight": name,
        "shape": [n, k],
        "mb": round(nbytes / 1e6, 1),
        "cublas_us": round(cublas, 2),
        "cublas_tb_s": round(nbytes / cublas / 1e6, 3),
        "kernel_default": list(gemv.tiling(n, k)),
        "kernel_default_us": round(default_us, 2),
        "kernel_default_tb_s": round(nbytes / default_us / 1e6, 3),
        "kernel_best": list(best[1]) if best else None,
        "kernel_best_us": round(best[0], 2) if best else None,
        "kernel_best_tb_s": round(nbytes / best[0] / 1e6, 3) if best else None,
        "max_abs_diff_vs_cublas": diff,
        "tilings_us": tried,
    }


def gemv_part(cfg: dict[str, Any], device: torch.device) -> list[dict[str, Any]]:
    rows = []
    for name, (n, k) in shapes(cfg).items():
        row = one_shape(name, n, k, device)
        print(json.dumps({k: v for k, v in row.items() if k != "tilings_us"}), flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    return rows


def pooled(model: torch.nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
    """Random weights for every tensor of `model`, laid out in one allocation as a pool lays
    them (cachedaemon/pool_plan.py: q|k|v and gate|up side by side, 256-byte aligned)."""
    from cachedaemon.pool_plan import side_by_side

    named = [*model.named_parameters(), *model.named_buffers()]
    named = [named[i] for i in side_by_side([n for n, _ in named])]
    offsets, at = [], 0
    for _, t in named:
        at = -(-at // 256) * 256
        offsets.append(at)
        at += t.numel() * t.element_size()
    pool = torch.empty(at, dtype=torch.uint8, device=device)
    state = {}
    for (name, t), off in zip(named, offsets, strict=True):
        view = pool[off : off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        if view.is_floating_point():
            view.normal_(0, 0.02)
        state[name] = view
    return state


def step_part(cfg: dict[str, Any], device: torch.device, sizes: list[int]) -> list[dict[str, Any]]:
    from cachedaemon.client import assign
    from engine.kvcache import KVCache
    from engine.model import DecoderLayer, LlamaForCausalLM, TPGroup
    from engine.modelargs import read_model_args

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(cfg))
        a = read_model_args(d)
    model = LlamaForCausalLM(a, TPGroup(), torch.bfloat16, device=str(device))
    assign(model, pooled(model, device))
    cache = KVCache(
        a.num_hidden_layers, a.num_key_value_heads, a.head_dim, 8192, torch.bfloat16, device
    )
    out = []
    # separate products; q|k|v and gate|up as one each; and one-row products on the kernel
    for mode in ("separate", "fused", "fused+gemv"):
        groups = model.fuse_projections()
        if mode == "separate":
            for layer in model.model.layers:
                assert isinstance(layer, DecoderLayer)
                layer.self_attn.qkv = layer.mlp.gate_up = None
            groups = 0
        gemv.enabled = mode.endswith("gemv")
        for row in step_rows(model, cache, device, sizes):
            row = {"mode": mode, "fused_groups": groups, **row}
            print(json.dumps(row, indent=1), flush=True)
            out.append(row)
        torch.cuda.empty_cache()
    gemv.enabled = False
    return out


def step_rows(
    model: Any, cache: Any, device: torch.device, sizes: list[int]
) -> list[dict[str, Any]]:
    from bench.step_profile import cuda_ms, run, seqs_of
    from engine.runner import Runner
    from engine.scheduler import Plan

    runner = Runner(model, device, cache, max_batch=max(sizes), max_len=2048, cuda_graphs=True)
    runner.warmup()
    while runner.capture_next():
        pass
    out, first, wrap = [], 0, cache.blocks - 17
    for size in sizes:
        seqs = seqs_of(size, first, wrap)
        first = (first + 17 * size) % wrap
        prefill = Plan(prefill=tuple(seqs))
        p_ids, p_batch = runner._inputs(prefill)
        prefill_ms = cuda_ms(lambda i=p_ids, b=p_batch: runner._run(i, b), reps=5)
        run(runner, prefill, seqs)
        walls = [run(runner, Plan(decode=tuple(seqs)), seqs) for _ in range(20)]
        ids, batch = runner._inputs(Plan(decode=tuple(seqs)))
        graphs = runner.graphs
        assert graphs is not None
        replay = cuda_ms(lambda g=graphs, i=ids, b=batch: g.replay(i, b))
        eager = cuda_ms(lambda i=ids, b=batch: runner._decode_and_sample(i, b), reps=5)
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(3):
                runner._decode_and_sample(ids, batch)
            torch.cuda.synchronize()
        per: dict[str, list[float]] = collections.defaultdict(list)
        for e in prof.events():
            if e.device_type.name == "CUDA":
                per[e.name].append(e.time_range.elapsed_us())
        kernels = sorted(
            ((name, sum(ts) / 3, len(ts) // 3) for name, ts in per.items()), key=lambda r: -r[1]
        )
        out.append(
            {
                "batch": size,
                "prefill_step_ms": round(prefill_ms, 3),  # the 64-token prompts, as run
                "decode_step_wall_ms": round(statistics.median(walls), 3),
                "graph_replay_ms": round(replay, 3),
                "eager_ms": round(eager, 3),
                "kernels_us_per_step": round(sum(r[1] for r in kernels), 1),
                "kernels": [
                    {"name": n[:110], "us": round(us, 1), "launches": c}
                    for n, us, c in kernels[:25]
                ],
            }
        )
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="llama-8b", choices=sorted(PRESETS))
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--part", action="append", choices=["gemv", "step"], help="default: both")
    p.add_argument("--sizes", default="1,128", help="batch sizes of --part step")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type != "cuda":
        raise SystemExit("decode_profile times CUDA kernels: --device must be a CUDA device")
    cfg = PRESETS[args.preset]
    result: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(args.device),
    }
    for part in args.part or ["gemv", "step"]:
        if part == "gemv":
            result["gemv"] = gemv_part(cfg, device)
        else:
            result["step"] = step_part(cfg, device, [int(s) for s in args.sizes.split(",")])
        if args.out:
            args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
