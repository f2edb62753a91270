"""Streams' pasts kept warm on the standby promoted next, so a migration there is short.

A continuation (supervisor/migration.py) hands the promoted standby the prompt and every
token already sent; computed from nothing, that prefill is most of a kill's stall (16
streams of a few hundred tokens each on an H200 with llama-8b: ~100 ms). So while a stream
runs, the router sends the heir (`PrimaryView.heir`, named by the supervisor) the stream's
past every `router.warm_every` tokens, `POST /holdfast/warm` under the stream's key: the
heir prefills what it has not kept yet and keeps the keys and values (engine/scheduler.py).
A continuation sent to that engine names the key, and prefills only the tokens after the
last past it kept. At most one warm request per stream is under way; a failed one is only
logged (the continuation then computes more). When the stream ends, the heir forgets it.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

import aiohttp
import structlog

from supervisor.migration import Stream
from supervisor.routing import UPSTREAM_ERRORS, Target

if TYPE_CHECKING:
    from supervisor.router import Router

log = structlog.get_logger("supervisor.router")
PATH = "/holdfast/warm"
TIMEOUT_S = 10.0


class Warmer:
    def __init__(self, router: Router) -> None:
        self.r = router
        self.every = router.spec.warm_every
        self.sent = 0  # warm requests answered 200
        self.failed = 0
        self._tasks: set[asyncio.Future[object]] = set()

    def heard(self, st: Stream) -> None:
        """After a chunk of `st` reached its client: its past goes to the heir when
        `every` tokens came since the last (at once on a new heir)."""
        heir = self.r.view.heir
        if not self.every or heir is None or st.warming or st.prompt_ids is None:
            return
        if st.warmed_on != heir.name:
            st.warmed_on, st.warmed = heir.name, 0
            st.warm_key = st.warm_key or uuid.uuid4().hex
        past = [*st.prompt_ids, *st.emitted]
        if st.warmed and len(past) - st.warmed < self.every:
            return
        left = st.left()
        if left is not None and left <= self.every // 2:
            return  # about to end: the continuation would be short anyway
        st.warming = True
        self._spawn(self._warm(heir, st, past))

    def key_for(self, st: Stream, target: Target) -> str:
        """The key a continuation on `target` names: its past is kept there."""
        return st.warm_key if st.warmed and st.warmed_on == target.name else ""

    def ended(self, st: Stream) -> None:
        """`st` is over: the engine keeping its past warm may forget it."""
        heir = self.r.view.heir
        if st.warmed and heir is not None and heir.name == st.warmed_on:
            st.warmed = 0
            self._spawn(self._post(heir, {"key": st.warm_key, "forget": True}))

    def _spawn(self, coro: Coroutine[Any, Any, object]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _warm(self, heir: Target, st: Stream, past: list[int]) -> None:
        try:
            kept = await self._post(heir, {"key": st.warm_key, "prompt": past})
            if kept and st.warmed_on == heir.name:
                st.warmed = len(past)
        finally:
            st.warming = False

    async def _post(self, heir: Target, body: dict[str, object]) -> bool:
        url = f"http://{heir.host}:{heir.port}{PATH}"
        timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
        try:
            async with self.r.client().post(url, json=body, timeout=timeout) as resp:
                await resp.read()
                ok = resp.status == 200
        except (TimeoutError, *UPSTREAM_ERRORS) as e:
            ok = False
            log.debug("warm_failed", engine=heir.name, error=type(e).__name__)
        else:
            if not ok:
                log.debug("warm_refused", engine=heir.name, status=resp.status)
        if "prompt" in body:
            if ok:
                self.sent += 1
            else:
                self.failed += 1
        return ok
