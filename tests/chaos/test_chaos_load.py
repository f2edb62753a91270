"""The load generator against a real aiohttp server on a real loopback socket."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web

from chaos.errors import ChaosError
from chaos.load import LoadGenerator
from chaos.scenario import ClientLoad


class Flaky:
    """Answers like an engine; the first `fail_first` attempts get a 503."""

    def __init__(self, fail_first: int) -> None:
        self.fail_first = fail_first
        self.seen = 0
        self.bodies: list[dict[str, object]] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.seen += 1
        self.bodies.append(await request.json())
        if self.seen <= self.fail_first:
            return web.Response(status=503)
        headers = {"X-Holdfast-Engine": "e1", "X-Holdfast-Epoch": "4"}
        return web.json_response({"choices": [{"token_ids": [1]}]}, headers=headers)


async def _serve(flaky: Flaky) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/v1/completions", flaky.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def test_rate_count_retries_and_headers() -> None:
    async def main() -> None:
        flaky = Flaky(fail_first=2)
        runner, url = await _serve(flaky)
        spec = ClientLoad(concurrency=2, rate=100.0, max_tokens=3, retries=3, max_requests=30)
        gen = LoadGenerator(url, spec, seed=1)
        began = time.monotonic()
        await gen.run(asyncio.Event(), duration_s=5.0)
        took = time.monotonic() - began
        await runner.cleanup()
        assert len(gen.rows) == 30
        assert all(r.ok and r.engine == "e1" and r.epoch == 4 for r in gen.rows)
        assert sum(r.attempts - 1 for r in gen.rows) == 2
        assert 0.25 < took < 3.0  # 30 requests at 100/s
        assert flaky.bodies[0]["max_tokens"] == 3 and len(flaky.bodies[0]["prompt_token_ids"]) == 8  # type: ignore[arg-type]

    asyncio.run(main())


def test_gives_up_after_retries_and_records_the_failure() -> None:
    async def main() -> None:
        flaky = Flaky(fail_first=1000)
        runner, url = await _serve(flaky)
        gen = LoadGenerator(url, ClientLoad(rate=50.0, retries=1, max_requests=3), seed=1)
        gen.fallback = ("e9", 7)
        await gen.run(asyncio.Event(), duration_s=5.0)
        await runner.cleanup()
        assert [(r.ok, r.status, r.attempts, r.engine) for r in gen.rows] == [
            (False, 503, 2, "e9")
        ] * 3

    asyncio.run(main())


def test_nothing_listening_is_a_failed_row_not_a_crash() -> None:
    async def main() -> None:
        gen = LoadGenerator("http://127.0.0.1:9", ClientLoad(rate=50.0, retries=0, max_requests=2))
        stop = asyncio.Event()
        await gen.run(stop, duration_s=5.0)
        assert len(gen.rows) == 2 and all(r.status == 0 and r.error for r in gen.rows)

    asyncio.run(main())


def test_stop_event_ends_the_load_promptly() -> None:
    async def main() -> None:
        runner, url = await _serve(Flaky(fail_first=0))
        gen = LoadGenerator(url, ClientLoad(rate=20.0))
        stop = asyncio.Event()
        task = asyncio.create_task(gen.run(stop))
        await asyncio.sleep(0.3)
        stop.set()
        await asyncio.wait_for(task, timeout=2.0)
        await runner.cleanup()
        assert 2 <= len(gen.rows) <= 10

    asyncio.run(main())


def test_refuses_a_non_loopback_target() -> None:
    with pytest.raises(ChaosError, match="not loopback"):
        LoadGenerator("http://10.0.0.8:8000", ClientLoad())
