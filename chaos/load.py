"""The load generator: a steady stream of completions through the router, every one recorded.

`concurrency` requests in flight, each of `prompt_tokens` prompt tokens asking for
`max_tokens` (with `ignore_eos`, exactly that many), greedily; back to back (closed loop) or, with
`rate`, at most that many requests/s. Bounded in count and time, loopback only.
A failed attempt (no answer, or 502/503/504) is retried after a short backoff, up to
`retries` times; the row keeps the attempt count. A 503 with Retry-After is the engine
shedding load: retried after the time it asks for, and counted as shed (not failed) when
every attempt was shed.

With `stream`, a share of the requests (`stream_fraction`) is streamed, and each such
client checks its stream as a user would (chaos/answers.py: `data: [DONE]`, the token
count, `: migrated` marks and their stalls). Streamed requests (with `twins: all`, every
request) draw their prompt from `twin_prompts` fixed prompts, so every greedy answer has
fault-free twins of its model version to be compared with (chaos/twins.py). Every row
keeps the version the router said made the answer.
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

from chaos.answers import Reply, StreamCheck, collected, retry_after
from chaos.errors import ChaosError
from chaos.scenario import ClientLoad
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
    tokens: int = 0  # output tokens of a successful answer (its usage.completion_tokens)
    shed: bool = False  # the last attempt was a 503 with Retry-After (load shed, not a failure)
    streamed: bool = False
    broken: bool = False  # a stream that did not end complete: an error event, a cut, a short one
    migrated: int = 0  # times the router continued the stream on the next primary
    stall_ms: float | None = None  # the longest stall a migration made the client see
    prompt: int = -1  # which of the twin prompts, -1: a random one
    digest: str = ""  # of a whole answer's token ids, to compare with its twins
    version: str = ""  # the model version the router said made it (X-Holdfast-Model-Version)
    fingerprint: str = ""  # a collected answer's system_fingerprint

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300 and not self.broken

    @property
    def failed(self) -> bool:
        return not self.ok and not self.shed

    @property
    def latency_ms(self) -> float:
        return (self.end - self.start) * 1000.0


def describe_load(spec: ClientLoad) -> str:
    """The load in words, for the report."""
    pace = "back to back" if not spec.rate else f"at most {spec.rate:g} requests/s in all"
    eos = ", ignore_eos" if spec.ignore_eos else ""
    streamed = ""
    if spec.stream:
        share = f"{spec.stream_fraction:.0%} of requests" if spec.stream_fraction < 1 else "all"
        streamed = f"; streamed: {share}, prompts from {spec.twin_prompts} twins"
    return (
        f"{spec.concurrency} concurrent clients, {pace}; {spec.prompt_tokens} prompt tokens, "
        f"{spec.max_tokens} output tokens{eos}; {spec.retries} retries{streamed}"
    )


class LoadGenerator:
    """Usage: `gen = LoadGenerator(url, spec)`; `await gen.run(stop)`; then read `gen.rows`."""

    def __init__(self, url: str, spec: ClientLoad, *, seed: int = 0) -> None:
        host = urlsplit(url).hostname or ""
        if host not in LOOPBACK:
            raise ChaosError(f"load target {url} is not loopback; point router.listen at 127.0.0.1")
        self.url = url.rstrip("/") + "/v1/completions"
        self.spec = spec
        self.fallback: tuple[str, int | None] = ("", None)
        self._rng = random.Random(seed)
        twins = random.Random(seed + 1)
        self._twins = [
            [twins.randrange(1, 200) for _ in range(spec.prompt_tokens)]
            for _ in range(spec.twin_prompts)
        ]
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
            interval = 1.0 / self.spec.rate if self.spec.rate else 0.0
            next_at = time.monotonic()
            for _ in range(self.spec.max_requests):
                if stop.is_set() or (deadline is not None and time.monotonic() >= deadline):
                    break
                await slots.acquire()
                group.create_task(self._one(session, slots))
                next_at = max(next_at + interval, time.monotonic() - interval)
                await _sleep_or_stop(stop, next_at - time.monotonic())

    async def _one(self, session: aiohttp.ClientSession, slots: asyncio.Semaphore) -> None:
        streamed = self.spec.stream and self._rng.random() < self.spec.stream_fraction
        twinned = streamed or self.spec.twins == "all"
        twin = self._rng.randrange(len(self._twins)) if twinned and self._twins else -1
        prompt = (
            self._twins[twin]
            if twin >= 0
            else [self._rng.randrange(1, 200) for _ in range(self.spec.prompt_tokens)]
        )
        body: dict[str, object] = {
            self.spec.prompt_key: prompt,
            "max_tokens": self.spec.max_tokens,
            "ignore_eos": self.spec.ignore_eos,
            "temperature": 0,  # greedy on any engine (vLLM samples at OpenAI's default of 1)
        }
        if streamed:
            body["stream"] = True
        start = time.time()
        try:
            row = await self._attempts(session, body, start)
        finally:
            slots.release()
        self._rows.append(msgspec.structs.replace(row, streamed=streamed, prompt=twin))

    async def _attempts(
        self, session: aiohttp.ClientSession, body: dict[str, object], start: float
    ) -> RequestRow:
        reply, attempt = Reply(0), 0
        for attempt in range(1, self.spec.retries + 2):
            reply = await self._post(session, body)
            if reply.status not in RETRY_STATUSES and reply.status != 0:
                break
            if attempt <= self.spec.retries:
                wait = self.spec.retry_backoff_ms / 1000.0
                if reply.retry_after is not None:  # shed: come back when the engine asks
                    wait = min(max(wait, reply.retry_after), self.spec.timeout_s)
                await asyncio.sleep(wait)
        engine, epoch = (reply.engine, reply.epoch) if reply.engine else self.fallback
        return RequestRow(
            start,
            time.time(),
            reply.status,
            attempt,
            engine,
            epoch,
            reply.error,
            tokens=reply.tokens,
            shed=reply.retry_after is not None,
            broken=reply.broken,
            migrated=reply.migrated,
            stall_ms=reply.stall_ms,
            digest=reply.digest,
            version=reply.version,
            fingerprint=reply.fingerprint,
        )

    async def _post(self, session: aiohttp.ClientSession, body: dict[str, object]) -> Reply:
        if body.get("stream"):
            return await self._post_stream(session, body)
        try:
            async with session.post(self.url, json=body) as resp:
                return collected(resp, await resp.read())
        except (aiohttp.ClientError, TimeoutError) as exc:
            return Reply(0, error=f"{type(exc).__name__}: {exc}"[:200])

    async def _post_stream(self, session: aiohttp.ClientSession, body: dict[str, object]) -> Reply:
        check = StreamCheck()
        expect = self.spec.max_tokens if self.spec.ignore_eos else None
        started: aiohttp.ClientResponse | None = None
        try:
            async with session.post(self.url, json=body) as resp:
                if resp.status != 200:
                    await resp.read()
                    retry = retry_after(resp.status, resp.headers.get("Retry-After"))
                    return Reply(resp.status, retry_after=retry)
                started = resp
                async for raw in resp.content:
                    check.line(raw, time.monotonic())
                return check.reply(resp, expect)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"[:200]
            if started is not None:  # cut after the answer began: a broken stream
                return check.cut(started, error)
            return Reply(0, error=error)


async def _sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    if seconds <= 0:
        return
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=seconds)
