"""Where a model step's time goes, in-process (no HTTP): per batch size, the wall time of a
whole decode step through the runner (inputs, graph replay, reading the tokens), the graph
replay alone and the eager forward alone (CUDA events), and one mixed prefill step.

On the CPU (float32, no graphs): per batch size, the prefill step, the decode step's wall
time, and the share of a decode step spent in each of the busiest operators (torch's
profiler), which is what sets how much a batch costs over one request.

    PYTHONPATH=. python bench/step_profile.py --model-dir /tmp/models/llama-8b --device cuda:0
    PYTHONPATH=. python bench/step_profile.py --model-dir /tmp/models/small --device cpu --sizes 1,8
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.engine_startup import machine  # noqa: E402
from cachedaemon.client import assign  # noqa: E402
from cachedaemon.loader import LoadOptions, load_state_dict  # noqa: E402
from engine.kvcache import KVCache  # noqa: E402
from engine.model import LlamaForCausalLM, TPGroup  # noqa: E402
from engine.modelargs import read_model_args  # noqa: E402
from engine.runner import Runner  # noqa: E402
from engine.scheduler import Plan, Seq  # noqa: E402


def cuda_ms(fn, reps: int = 20) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def seqs_of(size: int, first_block: int, wrap: int) -> list[Seq]:
    """`size` requests of 64 prompt tokens, 17 cache blocks each, the first from
    `first_block` on, each next one after it (block numbers modulo `wrap`)."""
    out = []
    for i in range(size):
        s = Seq(tuple((i * 7 + j) % 1000 + 3 for j in range(64)), 200, ignore_eos=True)
        start = (first_block + 17 * i) % wrap
        s.blocks = list(range(start, start + 17))
        out.append(s)
    return out


def run(runner: Runner, plan: Plan, seqs: list[Seq]) -> float:
    """One step; its tokens appended to the requests; its wall time in ms."""
    t = time.perf_counter()
    steps = runner.step(plan)
    ms = (time.perf_counter() - t) * 1e3
    for s, st in zip(seqs, steps, strict=True):
        s.out.append(st)
    return ms


def cpu_profile(args: argparse.Namespace) -> list[dict[str, object]]:
    device = torch.device("cpu")
    a = read_model_args(args.model_dir)
    model = LlamaForCausalLM(a, TPGroup(), torch.float32, device="cpu")
    assign(model, load_state_dict(args.model_dir, LoadOptions(dtype="float32", device="cpu")))
    sizes = [int(s) for s in args.sizes.split(",")]
    cache = KVCache(
        a.num_hidden_layers,
        a.num_key_value_heads,
        a.head_dim,
        args.kv_cache_mb,
        torch.float32,
        device,
    )
    wrap = cache.blocks - 17
    if wrap < 17 * max(sizes):
        raise SystemExit(f"--kv-cache-mb {args.kv_cache_mb} holds {cache.blocks} blocks; raise it")
    runner = Runner(model, device, cache, max_batch=max(sizes), max_len=2048, cuda_graphs=False)
    runner.warmup()
    rows: list[dict[str, object]] = []
    first = 0
    for size in sizes:
        seqs = seqs_of(size, first, wrap)
        first = (first + 17 * size) % wrap
        prefill_ms = run(runner, Plan(prefill=tuple(seqs)), seqs)
        walls = [run(runner, Plan(decode=tuple(seqs)), seqs) for _ in range(10)]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                run(runner, Plan(decode=tuple(seqs)), seqs)
        ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        total = sum(e.self_cpu_time_total for e in ops) or 1.0
        row: dict[str, object] = {
            "batch": size,
            "prefill_step_ms": round(prefill_ms, 1),
            "decode_step_wall_ms": round(statistics.median(walls), 1),
            "decode_step_wall_ms_all": [round(w, 1) for w in walls],
            "decode_share": {e.key: round(e.self_cpu_time_total / total, 3) for e in ops[:6]},
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model-dir", required=True)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--sizes", default="1,8,32,128")
    p.add_argument("--out", type=Path)
    p.add_argument("--kv-cache-mb", type=int, default=512, help="CPU only")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        rows = cpu_profile(args)
        if args.out:
            result = {
                "command": " ".join(sys.argv),
                "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "machine": machine(args.device),
                "threads": torch.get_num_threads(),
                "rows": rows,
            }
            args.out.write_text(json.dumps(result, indent=2) + "\n")
        return 0
    a = read_model_args(args.model_dir)
    model = LlamaForCausalLM(a, TPGroup(), torch.bfloat16, device=args.device)
    t0 = time.perf_counter()
    assign(
        model, load_state_dict(args.model_dir, LoadOptions(dtype="bfloat16", device=args.device))
    )
    print(f"loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    cache = KVCache(
        a.num_hidden_layers, a.num_key_value_heads, a.head_dim, 8192, torch.bfloat16, device
    )
    runner = Runner(model, device, cache, max_batch=128, max_len=2048, cuda_graphs=True)
    runner.warmup()
    while runner.capture_next():
        pass
    rows = []
    next_block, wrap = 0, cache.blocks - 17
    for size in [int(s) for s in args.sizes.split(",")]:
        seqs = seqs_of(size, next_block, wrap)
        next_block = (next_block + 17 * size) % wrap
        torch.cuda.synchronize()
        prefill_ms = run(runner, Plan(prefill=tuple(seqs)), seqs)
        walls = [run(runner, Plan(decode=tuple(seqs)), seqs) for _ in range(30)]
        ids, batch = runner._inputs(Plan(decode=tuple(seqs)))
        graphs = runner.graphs
        assert graphs is not None
        replay = cuda_ms(lambda g=graphs, i=ids, b=batch: g.replay(i, b))
        eager = cuda_ms(lambda i=ids, b=batch: runner._decode_and_sample(i, b), reps=5)
        t = time.perf_counter()
        for _ in range(20):
            runner._inputs(Plan(decode=tuple(seqs)))
        inputs_ms = (time.perf_counter() - t) * 1e3 / 20
        row = {
            "batch": size,
            "prefill_step_ms": round(prefill_ms, 2),
            "decode_step_wall_ms": round(statistics.median(walls), 3),
            "graph_replay_ms": round(replay, 3),
            "eager_forward_ms": round(eager, 3),
            "host_inputs_ms": round(inputs_ms, 3),
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    from engine.job import TOP_LOGPROBS_MAX
    from engine.sampling import sample, sample_kernel

    logits = torch.randn(128, a.vocab_size, device=device)
    print(
        json.dumps(
            {
                "sample_128_ms": round(cuda_ms(lambda: sample(logits, TOP_LOGPROBS_MAX)), 3),
                "sample_kernel_128_ms": round(
                    cuda_ms(lambda: sample_kernel(logits.bfloat16(), TOP_LOGPROBS_MAX)), 3
                ),
            }
        )
    )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
