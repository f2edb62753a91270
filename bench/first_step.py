"""A just-promoted standby's first real steps: what a migration asks of it, timed.

When a primary dies mid-stream the router sends each cut stream's continuation (its prompt
and the tokens already sent) to the promoted standby, which has served nothing yet: one
continuation comes first, alone, the rest in the next step beside its decode. This builds
the engine's runner in-process (no HTTP), warms it up as the engine does (`--warmup full`,
`Runner.warmup`'s default) or with one 1-token prefill only (`--warmup one`: what the
warm-up was before), captures the decode graphs, and times those steps twice: the first
time (cold) and again with new requests of the same shapes (warm). Run each warm-up in its
own process with an empty TRITON_CACHE_DIR, so neither finds the other's kernels on disk.

    PYTHONPATH=. python bench/first_step.py --model-dir /tmp/models/llama-8b --device cuda:0 \
        --warmup full --out first_step_full.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.engine_startup import machine  # noqa: E402
from cachedaemon.client import assign  # noqa: E402
from cachedaemon.loader import LoadOptions, load_state_dict  # noqa: E402
from engine.kvcache import KVCache, blocks_for  # noqa: E402
from engine.model import LlamaForCausalLM, TPGroup  # noqa: E402
from engine.modelargs import read_model_args  # noqa: E402
from engine.runner import Runner  # noqa: E402
from engine.scheduler import Plan, Seq  # noqa: E402

WARMUPS = {"full": None, "one": ((1,),)}


class Blocks:
    """Cache blocks handed out in order (the bench never frees any)."""

    def __init__(self, cache: KVCache) -> None:
        self.next, self.cache = 0, cache

    def seq(self, prompt_len: int, max_tokens: int, salt: int) -> Seq:
        s = Seq(tuple((salt * 131 + j) % 1000 + 3 for j in range(prompt_len)), max_tokens)
        n = blocks_for(prompt_len + max_tokens, self.cache.block_size)
        if self.next + n > self.cache.blocks:
            raise SystemExit("the KV cache is too small for the bench: raise --kv-cache-mb")
        s.blocks = list(range(self.next, self.next + n))
        self.next += n
        return s


def triton_entries() -> set[str]:
    """The kernels in Triton's disk cache: one directory per compiled specialization."""
    root = os.environ.get("TRITON_CACHE_DIR")
    if not root or not Path(root).is_dir():
        return set()
    return {f"{d.name[:8]}/{j.stem}" for d in Path(root).iterdir() for j in d.glob("*.json")}


def segments(device: torch.device) -> int:
    """cudaMalloc calls the caching allocator has made so far."""
    if device.type != "cuda":
        return 0
    return int(torch.cuda.memory_stats(device).get("segment.all.allocated", 0))


def timed(runner: Runner, plan: Plan, device: torch.device, why: dict | None = None) -> float:
    """One step (its tokens appended to its requests); its wall time in ms. With `why`,
    also what the step did the first time: the Triton kernels it compiled, the device
    allocations it made, and its costliest operators by host time (torch.profiler)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    kernels, segs = triton_entries(), segments(device)
    prof = None
    if why is not None:
        prof = torch.profiler.profile(record_shapes=False)
        prof.__enter__()
    t = time.perf_counter()
    for seq, step in zip(plan.seqs, runner.step(plan), strict=True):
        seq.out.append(step)
    ms = round((time.perf_counter() - t) * 1e3, 2)
    if why is not None and prof is not None:
        prof.__exit__(None, None, None)
        ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        why["top_host_ops_ms"] = [
            [e.key, round(e.self_cpu_time_total / 1e3, 2), e.count] for e in ops[:12]
        ]
    if why is not None:
        why["compiled"] = sorted(triton_entries() - kernels)
        why["cuda_mallocs"] = segments(device) - segs
    return ms


def migration(
    runner: Runner, blocks: Blocks, args: argparse.Namespace, salt: int, explain: bool = False
) -> dict:
    """The steps of one migration: the first continuation alone, then the rest beside its
    decode, then one decode of all; each step's ms (with `explain`, and what each did)."""
    first = blocks.seq(args.prompt_tokens, args.max_tokens, salt)
    rest = [
        blocks.seq(args.prompt_tokens + i, args.max_tokens, salt + i)
        for i in range(1, args.streams)
    ]
    d = runner.device
    why: dict[str, dict] = {"first_alone": {}, "rest_beside": {}, "decode_all": {}}
    alone = timed(runner, Plan(prefill=(first,)), d, why["first_alone"] if explain else None)
    beside = timed(
        runner,
        Plan(prefill=tuple(rest), decode=(first,)),
        d,
        why["rest_beside"] if explain else None,
    )
    decode = timed(runner, Plan(decode=(first, *rest)), d, why["decode_all"] if explain else None)
    out: dict = {"first_alone_ms": alone, "rest_beside_ms": beside, "decode_all_ms": decode}
    if explain:
        out["why"] = why
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--warmup", choices=sorted(WARMUPS), default="full")
    p.add_argument("--streams", type=int, default=16, help="cut streams in one migration")
    p.add_argument("--prompt-tokens", type=int, default=300, help="a continuation's prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--kv-cache-mb", type=int, default=8192)
    p.add_argument(
        "--explain",
        action="store_true",
        help="profile the cold steps: kernels compiled, device allocations, costliest host ops "
        "(the profiler adds its own cost to the cold times)",
    )
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    a = read_model_args(args.model_dir)
    model = LlamaForCausalLM(a, TPGroup(), dtype, device=args.device)
    opts = LoadOptions(dtype="bfloat16" if cuda else "float32", device=args.device)
    assign(model, load_state_dict(args.model_dir, opts))
    cache = KVCache(
        a.num_hidden_layers, a.num_key_value_heads, a.head_dim, args.kv_cache_mb, dtype, device
    )
    runner = Runner(model, device, cache, max_batch=128, max_len=2048, cuda_graphs=cuda)
    t = time.perf_counter()
    prompts = WARMUPS[args.warmup]
    runner.warmup(prompts)
    warmup_ms = round((time.perf_counter() - t) * 1e3, 1)
    while runner.capture_next():
        pass
    blocks = Blocks(cache)
    cold = migration(runner, blocks, args, salt=1, explain=args.explain)
    warm = migration(runner, blocks, args, salt=1000)
    result = {
        "benchmark": "first_step",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(args.device),
        "model_dir": args.model_dir,
        "warmup": args.warmup,
        "triton_cache_dir": os.environ.get("TRITON_CACHE_DIR", ""),
        "warmup_ms": warmup_ms,
        "streams": args.streams,
        "prompt_tokens": args.prompt_tokens,
        "cold": cold,
        "warm": warm,
    }
    print(json.dumps(result), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
