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

