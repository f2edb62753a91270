"""Serving throughput of the reference engine: single-stream decode and concurrent clients.

    PYTHONPATH=. python bench/engine_throughput.py --preset small --model-dir /tmp/models/small \
        --dtype float32 --concurrency 1,8 --out bench/results/engine_throughput_cpu.json
    PYTHONPATH=. python bench/engine_throughput.py --device cuda:0 --preset llama-8b \
        --model-dir /tmp/models/llama-8b --concurrency 1,32,128 --kv-cache-mb 16384 \
        --baseline --out /tmp/engine_throughput_h200.json

One cache daemon and one engine fork server, as the supervisor runs them; one engine forked
from it and attached to the daemon's pool. Measured, in this order:
- start: fork request to "ready", and to the last CUDA graph captured (after ready);
- single stream: one streamed request of --single-tokens tokens; ms per token is the time
  from its first token to its last over the tokens in between (median of 3);
- concurrency C: C clients, each sending one unmeasured warm-up request, then --rounds
  requests of --prompt-tokens random ids and --output-tokens output tokens (ignore_eos)
  back to back; output tokens/s over the wall time of those rounds.
With --baseline, transformers' own `generate` of the same checkpoint in the same run: a
static batch of 32 (and one stream) of the same shapes, greedy, after one warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import platform
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "bench")]

import aiohttp  # noqa: E402
from engine_startup import ForkServer, ensure_checkpoint, start_daemon  # noqa: E402

from engine.launch import EngineProcess  # noqa: E402

# llama-8b's bars by card: single-stream ms/token at most 1.25x the card's bandwidth floor,
# and 128 clients' output tokens/s (32 clients': an earlier, card-blind bar)
BARS = {
    "H100": {"single_ms_per_token": 6.0, "c32_tokens_per_s": 3000.0, "c128_tokens_per_s": 12000.0},
    "H200": {"single_ms_per_token": 4.2, "c32_tokens_per_s": 3000.0, "c128_tokens_per_s": 15000.0},
}


def bars_for(machine_name: str) -> dict[str, float]:
    """The bars of the card `machine()` names (an H100's for any other)."""
    return BARS["H200" if "H200" in machine_name else "H100"]


CPU_RATIO_BAR = 3.0  # 8 clients vs 1, CPU


def machine(device: str) -> str:
    if device.startswith("cuda"):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 else "cuda"
    return f"{platform.processor() or platform.machine()}, {len(__import__('os').sched_getaffinity(0))} cores"


async def stream_one(
    session: aiohttp.ClientSession, url: str, prompt: list[int], n: int
) -> list[float]:
    """Arrival times of each streamed token."""
    body = {"prompt_token_ids": prompt, "max_tokens": n, "ignore_eos": True, "stream": True}
    times: list[float] = []
    async with session.post(url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if (
                line.startswith(b"data: {")
                and b'"token_ids": [' in line
                and b'"token_ids": []' not in line
            ):
                times.append(time.perf_counter())
    return times


async def client(
    session: aiohttp.ClientSession,
    url: str,
    rounds: int,
    prompt_len: int,
    n: int,
    rng: random.Random,
) -> int:
    tokens = 0
    for _ in range(rounds):
        prompt = [rng.randrange(3, 250) for _ in range(prompt_len)]
        body = {"prompt_token_ids": prompt, "max_tokens": n, "ignore_eos": True}
        async with session.post(url + "/v1/completions", json=body) as resp:
            data = await resp.json()
            if resp.status != 200:
                raise SystemExit(f"request failed: {resp.status} {data}")
            tokens += data["usage"]["completion_tokens"]
    return tokens


async def measure(args: argparse.Namespace, url: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    timeout = aiohttp.ClientTimeout(total=600)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
        prompt = list(range(3, 3 + args.prompt_tokens))
        await stream_one(session, url, prompt, 8)  # warm-up
        per_token = []
        for _ in range(3):
            times = await stream_one(session, url, prompt, args.single_tokens)
            per_token.append((times[-1] - times[0]) * 1e3 / (len(times) - 1))
        out["single_ms_per_token"] = round(statistics.median(per_token), 3)
        out["single_ms_per_token_trials"] = [round(x, 3) for x in per_token]
        print(f"single stream: {out['single_ms_per_token']} ms/token", flush=True)
        for c in args.concurrency:
            rng = random.Random(c)
            await asyncio.gather(  # warm-up: the shapes this concurrency brings, unmeasured
                *(
                    client(session, url, 1, args.prompt_tokens, args.output_tokens, rng)
                    for _ in range(c)
                )
            )
            t0 = time.perf_counter()
            counts = await asyncio.gather(
                *(
                    client(session, url, args.rounds, args.prompt_tokens, args.output_tokens, rng)
                    for _ in range(c)
                )
            )
            wall = time.perf_counter() - t0
            tps = sum(counts) / wall
            out[f"c{c}_tokens_per_s"] = round(tps, 1)
            out[f"c{c}_requests"] = c * args.rounds
            out[f"c{c}_wall_s"] = round(wall, 3)
            print(
                f"concurrency {c}: {tps:.1f} output tokens/s ({sum(counts)} in {wall:.2f} s)",
                flush=True,
            )
    return out


def baseline(args: argparse.Namespace) -> dict[str, Any]:
    """transformers' generate on the same checkpoint: static batch of 32, and one stream."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype).to(args.device).eval()
    out: dict[str, Any] = {}
    for batch in (1, 32):
        ids = torch.randint(3, 250, (batch, args.prompt_tokens), device=args.device)
        kw = dict(
            max_new_tokens=args.output_tokens, min_new_tokens=args.output_tokens, do_sample=False
        )
        model.generate(ids, **kw)  # warm-up
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, **kw)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        out[f"hf_generate_b{batch}_tokens_per_s"] = round(batch * args.output_tokens / wall, 1)
        print(
            f"transformers generate, batch {batch}: {out[f'hf_generate_b{batch}_tokens_per_s']} tokens/s",
            flush=True,
        )
    del model
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--concurrency", default="1,8", help="comma-separated client counts")
    p.add_argument("--rounds", type=int, default=3, help="requests per client, after one warm-up")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--single-tokens", type=int, default=128)
    p.add_argument("--kv-cache-mb", type=int, default=4096)
    p.add_argument("--max-batch", type=int, default=128)
    p.add_argument("--baseline", action="store_true", help="also time transformers' generate")
    p.add_argument(
        "--spares",
        choices=("auto", "on", "off"),
        default="off",
        help="the fork server's --spares (the engine measured is its first start either way)",
    )
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--engine-flags", default="", help='more engine flags, e.g. "--matvec triton"')
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    ensure_checkpoint(args.model_dir, args.preset)
    result: dict[str, Any] = {
        "command": "PYTHONPATH=. python " + shlex.join(sys.argv),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(args.device),
        "preset": args.preset,
        "dtype": args.dtype,
        "shape": {
            "prompt_tokens": args.prompt_tokens,
            "output_tokens": args.output_tokens,
            "rounds": args.rounds,
        },
    }
    with tempfile.TemporaryDirectory(prefix="hf-bench-") as tmp:
        run_dir = Path(tmp)
        daemon, load_s = start_daemon(args, run_dir)
        fork = ForkServer(args, run_dir)
        engine = None
        try:
            flags = [
                "--model", str(args.model_dir), "--device", args.device, "--dtype", args.dtype,
                "--daemons", str(run_dir / "daemon-0.sock"), "--kv-cache-mb", str(args.kv_cache_mb),
                "--max-batch", str(args.max_batch), "--max-tokens-cap", "4096",
                *shlex.split(args.engine_flags),
            ]  # fmt: skip
            engine = EngineProcess(flags, forkserver=run_dir / "forkserver.sock")
            ready = engine.wait_ready(args.timeout)
            result["start_ready_s"] = round(engine.ready_at - engine.started_at, 3)
            result["startup_phases_ms"] = ready.get("phases")
            if args.device.startswith("cuda"):  # graphs are captured after ready
                done = engine.wait_events("decode graphs ready", 1, timeout=args.timeout)
                result["graphs"] = done[0] if done else "not captured"
                result["graphs_done_after_start_s"] = round(
                    time.perf_counter() - engine.started_at, 3
                )
            print(f"engine ready in {result['start_ready_s']} s (forked, attached)", flush=True)
            result.update(asyncio.run(measure(args, engine.url)))
        finally:
            if engine is not None:
                engine.stop()
            fork.proc.terminate()
            fork.proc.wait(30)
            daemon.terminate()
            daemon.wait(30)
    if args.baseline:
        result.update(baseline(args))
    if args.device.startswith("cuda"):
        result["bars"] = {
            k: {"bar": v, "got": result.get(k), "pass": _meets(k, result.get(k), v)}
            for k, v in bars_for(result.get("machine", "")).items()
        }
    elif 1 in args.concurrency and 8 in args.concurrency:
        ratio = result["c8_tokens_per_s"] / result["c1_tokens_per_s"]
        result["bars"] = {
            "c8_over_c1": {
                "bar": CPU_RATIO_BAR,
                "got": round(ratio, 2),
                "pass": ratio >= CPU_RATIO_BAR,
            }
        }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


def _meets(key: str, got: float | None, bar: float) -> bool:
    if got is None:
        return False
    return got <= bar if key.endswith("ms_per_token") else got >= bar


if __name__ == "__main__":
    sys.exit(main())
