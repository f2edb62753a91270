"""A promoted engine's first step for cut streams: from an adopted KV cache, or replayed.

In one process, with no HTTP and no other process on the cores: engine A serves `--streams`
streams on a shared KV cache (engine/kvshare.py) until each has `--tokens` tokens, and its
ledger is read then. Engine B, a standby with a small cache of its own, then either takes
A's cache over (`adopt`: a second mapping of the same memfd, as a promoted engine's is, and
the ledger's entries kept for the streams) or keeps a full cache of its own (`replay`),
and gets each stream's continuation (its prompt, the tokens in the ledger and the last one
sampled, as the router sends it when its client got every token). Adopting, B prefills
each stream's last token as it takes the cache over, and each continuation's first token
is the one that prefill sampled (engine/batcher.py `_ahead`). Timed: from the
continuations' submission to the first token of the last one, and the last step.
`--trials` times each, alternating.

    PYTHONPATH=. python bench/kv_adopt_step.py --model-dir /tmp/models/tiny --out kv_adopt_step.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import structlog
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.engine_startup import machine  # noqa: E402
from cachedaemon.client import assign  # noqa: E402
from cachedaemon.loader import LoadOptions, load_state_dict  # noqa: E402
from engine.batcher import BatchEngine  # noqa: E402
from engine.job import Job  # noqa: E402
from engine.kvcache import BLOCK_SIZE, BlockAllocator, KVCache, blocks_in  # noqa: E402
from engine.kvshare import Adopted, Entry, Layout, SharedKV  # noqa: E402
from engine.model import LlamaForCausalLM, TPGroup  # noqa: E402
from engine.modelargs import read_model_args  # noqa: E402
from engine.runner import Runner  # noqa: E402
from engine.scheduler import Scheduler  # noqa: E402


def engine(model_dir: Path, kv_mb: int, shared: SharedKV | None = None) -> BatchEngine:
    """The engine loop on the checkpoint in float32, its cache `shared`'s if given."""
    args = read_model_args(model_dir)
    model = LlamaForCausalLM(args, TPGroup(), torch.float32, device="cpu")
    opts = LoadOptions(dtype="float32", quantization="none", device="cpu")
    assign(model, load_state_dict(model_dir, opts))
    dims = (args.num_hidden_layers, args.num_key_value_heads, args.head_dim)
    tensors = shared.tensors() if shared is not None else None
    cache = KVCache(*dims, kv_mb, torch.float32, "cpu", tensors=tensors)
    runner = Runner(
        model, torch.device("cpu"), cache, max_batch=64, max_len=2048, cuda_graphs=False
    )
    runner.warmup()
    scheduler = Scheduler(
        BlockAllocator(cache.blocks),
        runner.eos,
        block_size=cache.block_size,
        max_running=64,
        max_waiting=64,
        prefill_tokens=8192,
    )
    out = BatchEngine(runner, scheduler)
    out.shared = shared
    return out


def primary_ledger(
    model_dir: Path, kv_mb: int, streams: int, tokens: int
) -> tuple[SharedKV, list[Entry]]:
    """Engine A's shared cache and its ledger once every stream has `tokens` tokens."""
    args = read_model_args(model_dir)
    dims = (args.num_hidden_layers, args.num_key_value_heads, args.head_dim)
    blocks = blocks_in(kv_mb, *dims, torch.float32, BLOCK_SIZE)
    layout = Layout(dims[0], blocks, BLOCK_SIZE, dims[1], dims[2], "float32", str(model_dir))
    shared = SharedKV.create(layout, 64, 2048)
    a = engine(model_dir, kv_mb, shared)
    a.start()
    got: dict[int, int] = dict.fromkeys(range(streams), 0)
    cancels = [threading.Event() for _ in range(streams)]

    def step(i: int) -> Any:
        return lambda _: got.__setitem__(i, got[i] + 1)

    futures = [
        a.submit(Job(prompt(i), tokens * 2, ignore_eos=True, kv_key=f"s{i}"), step(i), cancels[i])
        for i in range(streams)
    ]
    while min(got.values()) < tokens:
        time.sleep(0.005)
    entries = shared.read().entries
    for c in cancels:
        c.set()
    a.wake()
    for f in futures:
        f.result()
    a.stop_followers()
    return shared, entries


def prompt(i: int) -> tuple[int, ...]:
    return tuple((7 * i + 3 * j + 1) % 250 for j in range(16))


def continue_on(
    model_dir: Path, kv_mb: int, a: SharedKV, entries: list[Entry], mode: str
) -> dict[str, float]:
    """Engine B's continuations of the ledger's streams: their first tokens, and the step."""
    b = engine(model_dir, 1 if mode == "adopt" else kv_mb)
    if mode == "adopt":  # a second mapping of A's memfd, as a promoted engine's
        mine = SharedKV(*(os.dup(fd) for fd in a.fds))
        took = Adopted(mine, entries, [], (0, None))
        b.take_cache(engine_cache(model_dir, kv_mb, mine), took).result()
    b.start()
    firsts: dict[str, float] = {}
    t0 = time.perf_counter()

    def first(key: str) -> Any:
        return lambda _: firsts.setdefault(key, time.perf_counter() - t0)

    futures = [
        b.submit(Job((*e.tokens, sampled(e)), 4, ignore_eos=True, warm_key=e.key), first(e.key))
        for e in entries
    ]
    for f in futures:
        f.result()
    step_ms = b.stats().step_ms
    b.stop_followers()
    return {"first_tokens_ms": round(max(firsts.values()) * 1e3, 3), "last_step_ms": step_ms}


def sampled(e: Entry) -> int:
    assert e.sampled is not None, "the ledger names no token sampled last"
    return e.sampled.token


def engine_cache(model_dir: Path, kv_mb: int, shared: SharedKV) -> KVCache:
    args = read_model_args(model_dir)
    dims = (args.num_hidden_layers, args.num_key_value_heads, args.head_dim)
    return KVCache(*dims, kv_mb, torch.float32, "cpu", tensors=shared.tensors())


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--tokens", type=int, default=200, help="tokens each stream has at the cut")
    p.add_argument("--kv-cache-mb", type=int, default=1024)
    p.add_argument("--threads", type=int, default=1, help="torch's intra-op threads")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--out", type=Path)
    opts = p.parse_args()
    torch.set_num_threads(opts.threads)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    shared, entries = primary_ledger(opts.model_dir, opts.kv_cache_mb, opts.streams, opts.tokens)
    runs: dict[str, list[dict[str, float]]] = {"adopt": [], "replay": []}
    for _ in range(opts.trials):
        for mode in runs:
            runs[mode].append(continue_on(opts.model_dir, opts.kv_cache_mb, shared, entries, mode))
    out = {
        "command": " ".join(sys.argv),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine("cpu"),
        "streams": opts.streams,
        "past_tokens": [len(e.tokens) for e in entries],
        "runs": runs,
        "median": {
            mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
            for mode, rs in runs.items()
        },
    }
    print(json.dumps(out["median"], indent=1))
    if opts.out:
        opts.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
