"""A small torch-free engine for supervisor tests: aiohttp + the agent SDK.

POST /v1/completions answers `{"engine", "epoch", "role", "text"}`; `"sleep_s"` holds the
request that long (load), `"hold": true` holds it until `POST /release` (from then on
nothing is held), `"stream": true` sends the text in chunks, `"warn"` is printed as
a WARNING line on stderr. Each start and each request prints a line with the engine's pid.
GET /health answers 200.
`--no-agent` serves without the agent (the supervisor then checks GET /health).
`--fail-after S` exits with status 3 after S seconds; `--exit-now` exits at once with a
message on stderr (for quarantine tests); `--refuse-promote` fails every promotion.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

from aiohttp import web

from engine.agent_client import AgentClient
from holdfast_contract.env import read_env

ENV = read_env()


class Echo:
    def __init__(self, name: str) -> None:
        self.name = name
        self.epoch = ENV.epoch or 0
        self.role = ENV.role or "standby"
        self.in_flight = 0
        self.released = asyncio.Event()

    def promoted(self, epoch: int) -> None:
        self.epoch, self.role = epoch, "primary"

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body.get("warn"):
            print(f"WARNING echo pid={os.getpid()}: {body['warn']}", file=sys.stderr, flush=True)
        print(f"echo pid={os.getpid()}: request {body.get('prompt', '')!r}", file=sys.stderr)
        self.in_flight += 1
        try:
            await asyncio.sleep(float(body.get("sleep_s", 0)))
            if body.get("hold"):
                await self.released.wait()
            text = f"echo:{body.get('prompt', '')}"
            if not body.get("stream"):
                return web.json_response(
                    {"engine": self.name, "epoch": self.epoch, "role": self.role, "text": text}
                )
            resp = web.StreamResponse()
            await resp.prepare(request)
            try:
                for ch in text:
                    await resp.write(f"data: {ch}\n\n".encode())
                await resp.write(b"data: [DONE]\n\n")
                await resp.write_eof()
            except ConnectionResetError:  # the client left (the router took it as no stream)
                pass
            return resp
        finally:
            self.in_flight -= 1

    async def release(self, _: web.Request) -> web.Response:
        """Held requests answer now, and none is held from here on."""
        self.released.set()
        return web.json_response({"in_flight": self.in_flight})

    async def health(self, _: web.Request) -> web.Response:
        return web.json_response({"ok": True, "engine": self.name, "role": self.role})


def refuse(epoch: int) -> None:
    raise RuntimeError(f"refusing promotion to epoch {epoch} (--refuse-promote)")


async def follower() -> None:
    """Ranks other than 0 serve nothing; they live until told to stop (one_for_all)."""
    done = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, done.set)
    await done.wait()


async def serve(args: argparse.Namespace) -> None:
    if ENV.rank:
        await follower()
        return
    echo = Echo(ENV.name or "echo")
    print(f"echo pid={os.getpid()}: started", file=sys.stderr, flush=True)
    app = web.Application()
    app.router.add_post("/v1/completions", echo.complete)
    app.router.add_get("/health", echo.health)
    app.router.add_post("/release", echo.release)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", args.port).start()
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, done.set)
    agent = None if args.no_agent else AgentClient.from_env(load=lambda: (echo.in_flight, 0))
    if agent is not None:
        agent.on_promote(refuse if args.refuse_promote else echo.promoted)
        agent.on_stop(lambda: loop.call_soon_threadsafe(done.set))
        agent.start()
        agent.set_state("ready")
    try:
        if args.fail_after is not None:
            await asyncio.wait_for(done.wait(), timeout=args.fail_after)
        else:
            await done.wait()
    except TimeoutError:
        sys.exit(3)
    finally:
        if agent is not None:
            agent.close()
        await runner.cleanup()


def main() -> None:
    p = argparse.ArgumentParser(description="echo engine for supervisor tests")
    p.add_argument("--port", type=int, default=ENV.port or 8100)
    p.add_argument("--no-agent", action="store_true")
    p.add_argument("--fail-after", type=float)
    p.add_argument("--exit-now", action="store_true")
    p.add_argument("--refuse-promote", action="store_true")
    args = p.parse_args()
    if args.exit_now:
        print("echo: refusing to start (--exit-now)", file=sys.stderr)
        sys.exit(2)
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
