"""Greedy tokens of the reference engine alone and in a batch of 4 (same prompts): python3 det.py CHECKPOINT_DIR."""

import asyncio
import random
import subprocess
import sys

import aiohttp

port = 18977
p = subprocess.Popen(
    [
        sys.executable,
        "-m",
        "engine",
        "--model",
        sys.argv[1],
        "--allow-disk-fallback",
        "--port",
        str(port),
        "--role",
        "primary",
    ],
    stderr=subprocess.DEVNULL,
    stdout=subprocess.DEVNULL,
)


async def one(s, prompt, n=256):
    async with s.post(
        f"http://127.0.0.1:{port}/v1/completions",
        json={"prompt_token_ids": prompt, "max_tokens": n, "ignore_eos": True},
    ) as r:
        return (await r.json())["choices"][0]["token_ids"]


async def main():
    async with aiohttp.ClientSession() as s:
        for _ in range(300):
            try:
                async with s.get(f"http://127.0.0.1:{port}/health") as r:
                    if r.status == 200:
                        break
            except Exception:
                pass
            await asyncio.sleep(0.1)
        rng = random.Random(2)
        prompts = [[rng.randrange(1, 200) for _ in range(8)] for _ in range(8)]
        alone = [await one(s, q) for q in prompts]
        again = [await one(s, q) for q in prompts]
        print("alone reproducible:", again == alone)
        same = await asyncio.gather(*(one(s, prompts[0]) for i in range(4)))
        print("4 copies equal alone:", [o == alone[0] for o in same])
        diff = 0
        for trial in range(1):
            outs = await asyncio.gather(*(one(s, prompts[(i + trial) % 8]) for i in range(4)))
            for i, o in enumerate(outs):
                ref = alone[(i + trial) % 8]
                if o != ref:
                    diff += 1
                    k = next(j for j in range(len(o)) if o[j] != ref[j])
                    print("trial", trial, "req", i, "differs at", k)

        # staggered starts
        async def late(q, d):
            await asyncio.sleep(d)
            return await one(s, q)

        outs = await asyncio.gather(*(late(prompts[i], i * 0.05) for i in range(4)))
        for i, o in enumerate(outs):
            if o != alone[i]:
                k = next(j for j in range(len(o)) if o[j] != alone[i][j])
                print("staggered", i, "differs at", k)
        print("diff", diff)


asyncio.run(main())
p.terminate()
p.wait()
