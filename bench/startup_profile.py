"""Where an engine's start goes before ready, in fresh processes sharing one Triton cache.

    PYTHONPATH=. python bench/startup_profile.py --model-dir /tmp/models/llama-8b \
        --device cuda:0 --trials 3 --out /tmp/startup_profile.json

Each trial is a new interpreter that times, as the engine does them: importing torch and
the engine (Triton included), the CUDA context, building the model, loading the weights
(from disk, or with `--weights empty` allocated uninitialised; the weights' phase is
measured by bench/engine_startup.py), the KV cache, and the runner's warm-up, under
cProfile (`--whole`: every group of Runner.warmup's steps, each timed). The trials share a fresh TRITON_CACHE_DIR: the
first compiles the kernels, the later ones load them from Triton's disk cache, as an
engine restarted on the same machine does; the Triton preparation the fork server does
before forking (engine.forkserver.prepare_kernels) is timed with the imports. `--eager` warms up without the Triton kernels.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def child(args: argparse.Namespace) -> dict[str, Any]:
    t = time.perf_counter()
    out: dict[str, Any] = {}

    def lap(name: str) -> None:
        nonlocal t
        now = time.perf_counter()
        out[name + "_ms"] = round((now - t) * 1000, 1)
        t = now

    import torch

    lap("import_torch")
    sys.path.insert(0, str(REPO))
    from cachedaemon.client import assign
    from cachedaemon.loader import LoadOptions, load_state_dict
    from engine.kvcache import KVCache
    from engine.model import LlamaForCausalLM, TPGroup
    from engine.modelargs import read_model_args
    from engine.paged_decode import triton_ready
    from engine.runner import WARM_PREFILLS, WARM_PREFILLS_CUDA, Runner, unpack
    from engine.scheduler import Plan, Seq

    out["triton"] = triton_ready()
    if out["triton"] and not args.eager:  # as the fork server does before it forks
        from engine import fused, gemv, paged_decode
        from engine.forkserver import prepare_kernels

        prepare_kernels([paged_decode._kernel(), gemv._kernel(), *fused._kernels().values()])
    lap("import_engine")
    device = torch.device(args.device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    torch.empty(1, device=device)
    lap("cuda_context")
    a = read_model_args(args.model_dir)
    model = LlamaForCausalLM(a, TPGroup(), torch.bfloat16, device=args.device)
    lap("build")
    if args.weights == "disk":
        state = load_state_dict(args.model_dir, LoadOptions(dtype="bfloat16", device=args.device))
    else:  # the warm-up's time does not depend on the weights' values
        state = {
            n: torch.empty(t.shape, dtype=t.dtype, device=device)
            for n, t in [*model.named_parameters(), *model.named_buffers()]
        }
    assign(model, state)
    sync()
    lap("load_from_disk" if args.weights == "disk" else "weights_allocated")
    cache = KVCache(
        a.num_hidden_layers, a.num_key_value_heads, a.head_dim, 8192, torch.bfloat16, device
    )
    runner = Runner(model, device, cache, max_batch=128, max_len=2048, cuda_graphs=True)
    if args.eager:
        runner.kernel = False
    sync()
    lap("kv_cache_and_runner")
    prof = cProfile.Profile()
    prof.enable()
    if args.whole:  # Runner.warmup as an engine runs it, each group of its steps timed
        prompts = WARM_PREFILLS_CUDA if device.type == "cuda" else WARM_PREFILLS
        with runner._layers_of_each_kind():
            for lengths in prompts:
                runner._warm_steps((lengths,))
                sync()
                lap(f"warmup_{'x'.join(map(str, lengths))}")
    else:  # one prefill and one decode, timed apart
        seq = Seq((0,), 2, ignore_eos=True)
        seq.blocks = [cache.blocks]
        ids, batch = runner._inputs(Plan(prefill=(seq,)))
        seq.out.append(unpack(runner._decode_and_sample(ids, batch).tolist()[0], 0))
        lap("warmup_prefill")
        runner._decode_and_sample(*runner._inputs(Plan(decode=(seq,))))
        sync()
        lap("warmup_decode")
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats(args.sort).print_stats(45)
    out["warmup_profile"] = s.getvalue()[-12000:]
    t = time.perf_counter()
    while runner.capture_next():
        pass
    lap("capture_all_graphs")
    return out


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model-dir", required=True)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--eager", action="store_true")
    p.add_argument(
        "--weights",
        choices=["disk", "empty"],
        default="disk",
        help="the weights read from --model-dir, or allocated uninitialised (faster; the "
        "warm-up's time does not depend on their values)",
    )
    p.add_argument(
        "--whole",
        action="store_true",
        help="profile Runner.warmup's steps as an engine runs them (one layer of each kind on "
        "CUDA), each group timed, rather than one prefill and one decode",
    )
    p.add_argument("--sort", default="cumulative", help="the profile's order (pstats)")
    p.add_argument("--child", action="store_true")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return 0
    env = dict(os.environ, TRITON_CACHE_DIR=tempfile.mkdtemp(prefix="triton-"))
    trials = []
    for i in range(args.trials):
        cmd = [sys.executable, __file__, "--child", "--model-dir", args.model_dir]
        cmd += ["--device", args.device] + (["--eager"] if args.eager else [])
        cmd += ["--weights", args.weights, "--sort", args.sort] + (
            ["--whole"] if args.whole else []
        )
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            print(r.stdout[-3000:], r.stderr[-3000:])
            return 1
        res = json.loads(line[7:])
        trials.append(res)
        brief = {k: v for k, v in res.items() if k.endswith("_ms")}
        print(f"trial {i} eager={args.eager}: {brief}", flush=True)
        if i < 2:
            print(res["warmup_profile"], flush=True)
    if args.out:
        args.out.write_text(json.dumps({"command": sys.argv, "trials": trials}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
