"""The load generator: a steady stream of completions through the router, every one recorded.

Open loop at `rate` requests/s, at most `concurrency` in flight, bounded in count and time,
loopback only. A failed attempt (no answer, or 502/503/504) is retried after a short
backoff, up to `retries` times; the row keeps the attempt count.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from urllib.parse import urlsplit

import aiohttp
import msgspec
import structlog

from chaos.errors import ChaosError
from chaos.scenario import LoadSpec
from chaos.waiters import Rows

log = structlog.get_logger("chaos.load")

LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
RETRY_STATUSES = frozenset({502, 503, 504})


class RequestRow(msgspec.Struct, frozen=True):
    start: float  # wall clock, seconds
    end: float
    status: int  # HTTP status of the last attempt; 0 when nothing answered
    attempts: int
    engine: str  # X-Holdfast-Engine, or the primary the cluster named at the time
    epoch: int | None
    error: str = ""

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    @property
    def latency_ms(self) -> float:
        return (self.end - self.start) * 1000.0


class LoadGenerator:
    """Usage: `gen = LoadGenerator(url, spec)`; `await gen.run(stop)`; then read `gen.rows`."""

    def __init__(self, url: str, spec: LoadSpec, *, seed: int = 0) -> None:
        host = urlsplit(url).hostname or ""
        if host not in LOOPBACK:
            raise ChaosError(f"load target {url} is not loopback; point router.listen at 127.0.0.1")
        self.url = url.rstrip("/") + "/v1/completions"
        self.spec = spec
        self.fallback: tuple[str, int | None] = ("", None)
        self._rng = random.Random(seed)
        self._rows: Rows[RequestRow] = Rows()

    @property
    def rows(self) -> list[RequestRow]:
        return self._rows.items

    async def first_ok_after(self, ts: float, timeout: float) -> RequestRow | None:
        """The first successful request started at or after `ts`, waiting up to `timeout`."""
        return await self._rows.first(lambda r: r.ok and r.start >= ts, timeout)

    async def run(self, stop: asyncio.Event, *, duration_s: float | None = None) -> None:
        """Send until `stop` is set, `duration_s` passes or `max_requests` were sent."""
        deadline = time.monotonic() + duration_s if duration_s is not None else None
        slots = asyncio.Semaphore(self.spec.concurrency)
        timeout = aiohttp.ClientTimeout(total=self.spec.timeout_s)
        connector = aiohttp.TCPConnector(limit=self.spec.concurrency, force_close=True)
        async with (
            aiohttp.ClientSession(timeout=timeout, connector=connector) as session,
            asyncio.TaskGroup() as group,
        ):
            interval = 1.0 / self.spec.rate
            next_at = time.monotonic()
            for _ in range(self.spec.max_requests):
                if stop.is_set() or (deadline is not None and time.monotonic() >= deadline):
                    break
                await slots.acquire()
                group.create_task(self._one(session, slots))
                next_at = max(next_at + interval, time.monotonic() - interval)
                await _sleep_or_stop(stop, next_at - time.monotonic())

    async def _one(self, session: aiohttp.ClientSession, slots: asyncio.Semaphore) -> None:
        body = {
            "prompt_token_ids": [
                self._rng.randrange(1, 200) for _ in range(self.spec.prompt_tokens)
            ],
            "max_tokens": self.spec.max_tokens,
        }
        start = time.time()
        try:
            row = await self._attempts(session, body, start)
        finally:
            slots.release()
        self._rows.append(row)

    async def _attempts(
        self, session: aiohttp.ClientSession, body: object, start: float
    ) -> RequestRow:
        status, engine, epoch, error = 0, "", None, ""
        attempt = 0
        for attempt in range(1, self.spec.retries + 2):
            status, engine, epoch, error = await self._post(session, body)
            if status not in RETRY_STATUSES and status != 0:
                break
            if attempt <= self.spec.retries:
                await asyncio.sleep(self.spec.retry_backoff_ms / 1000.0)
        if not engine:
            engine, epoch = self.fallback
        return RequestRow(start, time.time(), status, attempt, engine, epoch, error)

    async def _post(
        self, session: aiohttp.ClientSession, body: object
    ) -> tuple[int, str, int | None, str]:
        try:
            async with session.post(self.url, json=body) as resp:
                await resp.read()
                epoch_text = resp.headers.get("X-Holdfast-Epoch", "")
                epoch = int(epoch_text) if epoch_text.isdigit() else None
                return resp.status, resp.headers.get("X-Holdfast-Engine", ""), epoch, ""
        except (aiohttp.ClientError, TimeoutError) as exc:
            return 0, "", None, f"{type(exc).__name__}: {exc}"[:200]


async def _sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    if seconds <= 0:
        return
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=seconds)
