"""A relayed answer that is not a stream, cut by its upstream after its first bytes (a node
killed while it sends), is retried on the next primary: its client gets that one's whole
answer, never a short one. A real router on real ports; the first upstream is a socket
server that sends part of an answer and closes, the next one an aiohttp app."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from aiohttp import web

from holdfast_contract.wire import free_port
from supervisor.policy import RouterSpec
from supervisor.primary import PrimaryView, Target
from supervisor.proxy.router import Router

WHOLE = {"object": "list", "data": [{"id": "from-the-next-primary"}]}


async def through_a_cut() -> tuple[int, Any, int]:
    """GET /v1/models through a router whose primary sends 40 of the 100 body bytes it
    announces, routes to the next primary and closes: (status, body, requests the next
    primary got)."""
    view = PrimaryView()
    router = Router(RouterSpec(retry_deadline_s=10), view)
    served: list[str] = []

    async def models(request: web.Request) -> web.Response:
        served.append(request.path)
        return web.json_response(WHOLE)

    nxt = web.Application()
    nxt.router.add_get("/v1/models", models)
    nxt_runner, runner = web.AppRunner(nxt), web.AppRunner(router.app())
    await nxt_runner.setup()
    await runner.setup()
    nxt_port, port = free_port(), free_port()
    await web.TCPSite(nxt_runner, "127.0.0.1", nxt_port).start()
    await web.TCPSite(runner, "127.0.0.1", port).start()

    async def dying(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
            + b'{"object": "list", "data": [{"id": "f'
        )
        await writer.drain()
        view.set(Target("next", nxt_port, 2))  # promoted as the first one dies
        writer.transport.abort()

    first = await asyncio.start_server(dying, "127.0.0.1", 0)
    first_port = first.sockets[0].getsockname()[1]
    view.set(Target("first", first_port, 1))
    try:
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"http://127.0.0.1:{port}/v1/models") as r,
        ):
            return r.status, json.loads(await r.read()), len(served)
    finally:
        first.close()
        await runner.cleanup()
        await nxt_runner.cleanup()


def test_an_answer_cut_after_its_first_bytes_is_retried_whole_on_the_next_primary() -> None:
    status, body, served = asyncio.run(through_a_cut())
    assert (status, body) == (200, WHOLE)
    assert served == 1
