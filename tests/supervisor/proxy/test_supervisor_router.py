"""The router's own answers have the engines' JSON error shape: a body over its limit is a
413, no primary within the retry deadline a 502, each `{"error": {"message", "type"}}`."""

from __future__ import annotations

import asyncio
import io
from typing import Any

import aiohttp
from aiohttp import web

from holdfast_contract.wire import free_port
from supervisor.policy import RouterSpec
from supervisor.primary import PrimaryView
from supervisor.proxy.router import Router

MAX_BODY = 64 * 1024 * 1024  # the router's documented limit


async def answers(*bodies: bytes) -> list[tuple[int, str, Any]]:
    """Each body POSTed through a real router (no primary) on a real port."""
    router = Router(RouterSpec(retry_deadline_s=0.1), PrimaryView())
    runner = web.AppRunner(router.app())
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    out = []
    try:
        async with aiohttp.ClientSession() as http:
            for body in bodies:
                url = f"http://127.0.0.1:{port}/v1/completions"
                async with http.post(url, data=io.BytesIO(body)) as r:
                    out.append((r.status, r.content_type, await r.json()))
    finally:
        await runner.cleanup()
    return out


def test_router_errors_have_the_json_error_shape() -> None:
    big, small = b"x" * (MAX_BODY + 1), b'{"prompt": "hi"}'
    (s1, t1, j1), (s2, t2, j2) = asyncio.run(answers(big, small))
    assert (s1, t1) == (413, "application/json")
    assert j1 == {
        "error": {
            "message": f"request body of {MAX_BODY + 1} bytes is over the router's limit of "
            f"{MAX_BODY} bytes",
            "type": "invalid_request_error",
        }
    }
    assert (s2, t2) == (502, "application/json")
    assert j2 == {"error": {"message": "no primary is serving", "type": "upstream_error"}}


async def held_then_stopped() -> tuple[int, Any, float]:
    """A request held for a primary (none comes within a long deadline) while the router
    is told to stop: (status, body, seconds from the stop to the answer)."""
    router = Router(RouterSpec(retry_deadline_s=60), PrimaryView())
    runner = web.AppRunner(router.app())
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with aiohttp.ClientSession() as http:
            url = f"http://127.0.0.1:{port}/v1/models"
            held = asyncio.ensure_future(http.get(url))
            while router.in_flight == 0:  # (the router's own state, in this loop)
                await asyncio.sleep(0)
            stopped_at = asyncio.get_running_loop().time()
            router.stop()
            async with await held as r:
                body = await r.json()
                return r.status, body, asyncio.get_running_loop().time() - stopped_at
    finally:
        await runner.cleanup()


def test_a_request_held_for_a_primary_is_answered_when_the_router_stops() -> None:
    status, body, waited = asyncio.run(held_then_stopped())
    assert status == 502, body
    assert body == {"error": {"message": "no primary is serving", "type": "upstream_error"}}
    assert waited < 30  # not the retry deadline (60 s)
