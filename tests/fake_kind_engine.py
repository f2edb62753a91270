"""The engine of tests/fake_kind.py: `GET /health`, `GET /load` and `POST /v1/completions`,
streamed as an OpenAI-style engine with `return_token_ids` streams (each character of
`<greeting>:<prompt>` one token, its id the character's code), or one JSON body."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from aiohttp import web


def chunk(text: str, ids: list[int], finish: str | None, prompt: list[int] | None) -> bytes:
    choice: dict[str, Any] = {"index": 0, "text": text, "token_ids": ids, "finish_reason": finish}
    if prompt is not None:
        choice["prompt_token_ids"] = prompt
    event = {"id": "cmpl-fake", "object": "text_completion", "created": 1, "model": "fake"}
    return b"data: " + json.dumps({**event, "choices": [choice]}).encode() + b"\n\n"


def app(greeting: str, load: int) -> web.Application:
    async def complete(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = str(body.get("prompt", ""))
        answer = f"{greeting}:{prompt}"
        if not body.get("stream"):
            return web.json_response({"choices": [{"index": 0, "text": answer}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, ch in enumerate(answer):
            last = i == len(answer) - 1
            first = [ord(c) for c in prompt] if i == 0 else None
            await resp.write(chunk(ch, [ord(ch)], "stop" if last else None, first))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def load_now(_: web.Request) -> web.Response:
        return web.json_response({"in_flight": load})

    a = web.Application()
    a.router.add_post("/v1/completions", complete)
    a.router.add_get("/health", health)
    a.router.add_get("/load", load_now)
    return a


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--greeting", required=True)
    parser.add_argument("--load", type=int, default=0)
    args = parser.parse_args()
    print(f"fake engine pid={os.getpid()} greeting={args.greeting}", file=sys.stderr, flush=True)
    web.run_app(app(args.greeting, args.load), host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
