"""One prefill step of the reference engine on the CPU, by dtype and torch intra-op threads:
the cost of the continuations a kill leaves the promoted standby (4 streams, up to 256
emitted tokens each). The tiny preset's shapes, random weights; no router, no fault.

    python3 bench/results/chaos-streams/engine_prefill_cost.py [DTYPE] [THREADS]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from cachedaemon.checkpoint_gen import make_checkpoint
from engine.kvcache import KVCache
from engine.model import LlamaForCausalLM, TPGroup
from engine.modelargs import read_model_args
from engine.runner import Runner
from engine.scheduler import Plan, Seq

PROMPTS = ([8], [8] * 4, [130], [264], [130] * 4, [264] * 4)


def main() -> None:
    dtype = getattr(torch, sys.argv[1] if len(sys.argv) > 1 else "float32")
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        args = read_model_args(make_checkpoint(Path(tmp) / "tiny", "tiny"))
    torch.set_num_threads(threads)
    model = LlamaForCausalLM(args, TPGroup(), dtype, device="cpu")
    model.to_empty(device="cpu")
    with torch.no_grad():
        for t in (*model.parameters(), *model.buffers()):
            t.normal_(0, 0.02)
    kv = KVCache(args.num_hidden_layers, args.num_key_value_heads, args.head_dim, 256, dtype, "cpu")
    runner = Runner(model, torch.device("cpu"), kv, max_batch=128, max_len=512, cuda_graphs=False)
    runner.warmup()
    print(f"dtype {sys.argv[1] if len(sys.argv) > 1 else 'float32'}, {threads} thread(s)")
    for lens in PROMPTS:
        ms = []
        for _ in range(7):
            seqs = []
            for i, n in enumerate(lens):
                seq = Seq(tuple(range(n)), 8, ignore_eos=True)
                seq.blocks = list(range(1 + 20 * i, 21 + 20 * i))
                seqs.append(seq)
            t0 = time.perf_counter()
            runner.step(Plan(prefill=tuple(seqs)))
            ms.append((time.perf_counter() - t0) * 1e3)
        shown = "x".join(map(str, (len(lens), lens[0])))
        print(
            f"  prefill {shown:>6} tokens: median {statistics.median(ms):6.1f} ms, max {max(ms):6.1f}"
        )


if __name__ == "__main__":
    main()
