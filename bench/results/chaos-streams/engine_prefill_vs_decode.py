"""Continuations sent straight to the reference engine (prompt + the first k tokens of an uninterrupted answer) against that answer: python3 cont.py CHECKPOINT_DIR."""

import asyncio
import random
import subprocess
import sys

import aiohttp

port = 18978
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


async def one(s, prompt, n):
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
        tw = random.Random(2)
        prompts = [[tw.randrange(1, 200) for _ in range(8)] for _ in range(8)]
        bad = 0
        total = 0
        for q in prompts[:4]:
            ref = await one(s, q, 256)
            for k in range(1, 256, 7):
                c = await one(s, q + ref[:k], 256 - k)
                total += 1
                if c != ref[k:]:
                    bad += 1
                    j = next(i for i in range(len(c)) if c[i] != ref[k + i])
                    if bad < 6:
                        print("cut", k, "first diff at +", j)
        print("bad", bad, "of", total)


asyncio.run(main())
p.terminate()
p.wait()
