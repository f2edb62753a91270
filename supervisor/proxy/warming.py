"""Streams' pasts kept warm on the standby promoted next, so a migration there is short.

A continuation (supervisor/proxy/migration.py) hands the promoted standby the prompt and every
token already sent; computed from nothing, that prefill is most of a kill's stall (16
streams of a few hundred tokens each on an H200 with llama-8b: ~100 ms). So while a stream
runs, the router sends the heir (`PrimaryView.heir`, named by the supervisor) the stream's
past every `router.warm_every` tokens, `POST /holdfast/warm` under the stream's key: the
heir prefills what it has not kept yet and keeps the keys and values (engine/scheduler.py).
A continuation sent to that engine names the key, and prefills only the tokens after the
last past it kept. At most one warm request per stream is under way; a failed one is only
logged (the continuation then computes more). When the stream ends, the heir forgets it
(after the warm request under way, if one is).

Each prefill on the heir reads all the weights, as a decode step of the primary beside it
on the same device does; one per stream would cost the primary a step every few tokens. So
when one stream is due, every other stream with half as many tokens not yet sent goes with
it, at once: the heir prefills them in one step (engine/batcher.py), a few times a second.
Right after a failover nothing goes to the new heir until every cut stream has its first
token again: those are what the clients wait on.

A completion whose prompt is token ids has its prompt sent to the heir as it arrives, while
the primary prefills it, not after its first token: a primary killed in a stream's first
tokens (its first past would still be on its way) leaves it continuing from its prompt
kept, not from nothing. A text prompt's ids come with the first chunk, and its past is
sent then.
"""

from __future__ import annotations

import asyncio
import time
import uuid
import weakref
from collections.abc import Callable, Coroutine
from typing import Any

import aiohttp
import structlog

from supervisor.primary import PrimaryView, Target
from supervisor.proxy.migration import COMPLETIONS, Stream
from supervisor.proxy.routing import UPSTREAM_ERRORS

log = structlog.get_logger("supervisor.router")
PATH = "/holdfast/warm"
TIMEOUT_S = 10.0
RESUMING_S = 1.0  # a stream cut this long ago holds back no heir's warming any more


class Warmer:
    """The warming of one router (`router.warm_every`): its heir is `view.heir`, its
    requests go out on the router's `client()`."""

    def __init__(
        self,
        every: int,
        view: PrimaryView,
        client: Callable[[], aiohttp.ClientSession],
        *,
        kv_keys: bool = False,
    ) -> None:
        # with kv_keys (engines.kv_adopt) nothing is warmed: each stream goes out under a
        # key of its own (`holdfast_kv`), which the primary's shared KV cache lists it
        # under; the standby promoted after its death keeps each stream's past there, and
        # a continuation names that key
        self.kv_keys = kv_keys
        self.every = 0 if kv_keys else every
        self.view = view
        view.warm_on = self.warm_on  # what a refit's switch waits for (supervisor/update/)
        self.client = client
        self.sent = 0  # warm requests answered 200
        self.failed = 0
        self._tasks: set[asyncio.Future[object]] = set()
        # streams under way, by id (weakly: one replaced by a fresh copy leaves by itself)
        self._live: weakref.WeakValueDictionary[int, Stream] = weakref.WeakValueDictionary()

    def arrived(self, st: Stream) -> None:
        """A stream is about to start: its prompt goes to the heir now, if it is token ids
        (with kv_keys: it gets its key)."""
        if self.kv_keys:
            st.kv_key = st.kv_key or uuid.uuid4().hex
            return
        ids = _prompt_ids(st.request) if st.path == COMPLETIONS else None
        if not self.every or ids is None:
            return
        self._live[id(st)] = st  # a refit's switch waits for its prompt too (`warm_on`)
        heir = self.view.heir
        if heir is None or self._runs_on(st, heir):
            return
        st.warmed_on, st.warmed = _kept_by(heir), 0
        st.warm_key = st.warm_key or uuid.uuid4().hex
        st.warming = True
        self._spawn(self._warm(heir, st, ids))

    def heard(self, st: Stream) -> None:
        """After a chunk of `st` reached its client: its past goes to the heir when
        `every` tokens came since the last (at once on a new heir), and with it the past
        of every other stream `every // 2` tokens on."""
        if not self.every or st.prompt_ids is None:
            return
        # every stream under way, heir or none: a refit's switch waits for all of them
        # (`warm_on`), those heard before its heir was named too
        self._live[id(st)] = st
        heir = self.view.heir
        if heir is None:
            return
        for other in self.due(st, heir):
            other.warming = True
            self._spawn(self._warm(heir, other, [*(other.prompt_ids or ()), *other.emitted]))

    def due(self, st: Stream, heir: Target) -> list[Stream]:
        """The streams whose pasts go to `heir` now that a chunk of `st` came: `st` when
        `every` tokens came since its last, and with it every other stream `every // 2`
        on. None while a cut stream still waits for its continuation's first token (for at
        most RESUMING_S): a new heir's first warm is every stream's whole past at once, 16
        requests and connections that would go out between those streams' first tokens
        and delay them (about 8 ms of the router's time on an H200 failover)."""
        now = time.monotonic()
        if any(o.cut_at and now - o.cut_at < RESUMING_S for o in self._live.values()):
            return []
        if self._runs_on(st, heir) or not self._due(st, heir, self.every):
            return []
        return [
            o
            for o in list(self._live.values())
            if not self._runs_on(o, heir) and (o is st or self._due(o, heir, self.every // 2))
        ]

    def _runs_on(self, st: Stream, heir: Target) -> bool:
        """Whether `st` runs on `heir` itself: a refit's new primary is the heir until the
        old one cuts its streams (supervisor/update/refit.py), and what runs there already
        has its past there."""
        t = self.view.target
        return t is not None and t.name == heir.name and (not st.epoch or st.epoch == t.epoch)

    def _due(self, st: Stream, heir: Target, tokens: int) -> bool:
        """Whether `st`'s past is worth sending to `heir`: `tokens` came since the last
        it kept (all of it on a new heir), and the stream is not about to end."""
        if st.warming or st.prompt_ids is None:
            return False
        if st.warmed_on != _kept_by(heir):  # another heir, or the heir on new weights
            st.warmed_on, st.warmed = _kept_by(heir), 0
            st.warm_key = st.warm_key or uuid.uuid4().hex
        if st.warmed and len(st.prompt_ids) + len(st.emitted) - st.warmed < tokens:
            return False
        left = st.left()
        return left is None or left > self.every // 2  # else the continuation is short anyway

    def key_for(self, st: Stream, target: Target) -> str:
        """The key a continuation on `target` names: its past is kept there, or on its way
        (a prefill of it under way there is taken over when it ends; one still queued
        gives way to the continuation, engine/scheduler.py). With kv_keys, the stream's
        own: the engine keeps its past under it if it adopted the dead primary's cache."""
        if self.kv_keys:
            return st.kv_key
        return st.warm_key if self.kept(st, target) or self._warming_on(st, target) else ""

    def kept(self, st: Stream, target: Target) -> int:
        """The tokens of `st`'s past kept on `target` (on the weights it runs now): where
        it is the heir now, or was one before (a switch's heir, when the superseded primary
        back as a standby has become the heir since, before the stream's cut was seen)."""
        place = _kept_by(target)
        return st.warmed if st.warmed_on == place else st.kept_at.get(place, 0)

    def _warming_on(self, st: Stream, target: Target) -> bool:
        return st.warming and st.warmed_on == _kept_by(target)

    def warm_on(self, heir: Target) -> bool:
        """Whether every stream under way has its past kept on `heir` (on the weights it
        runs now) to within `every` tokens, or a later past on its way there, but for
        those about to end: a switch to it (a refit's, whose cut streams go on there) then
        costs each stream only its last few tokens' prefill. A past kept long ago is not
        warm: a stream whose prompt alone is kept would compute all it made since. Nor is
        a first past still on its way: a continuation that comes before its prefill runs
        takes its place (engine/scheduler.py), and then has nothing kept there."""
        for st in list(self._live.values()):
            if st.over:
                continue
            left = st.left()
            if left is not None and left <= self.every // 2:
                continue
            if st.warmed_on != _kept_by(heir) or not st.warmed:
                return False
            if st.warming:
                continue  # a later past on its way; what is kept stays if it gives way
            # before its first chunk a stream's past is its prompt, whole when kept at all
            past = st.warmed if st.prompt_ids is None else len(st.prompt_ids) + len(st.emitted)
            if past - st.warmed > self.every:
                return False
        return True

    def ended(self, st: Stream) -> None:
        """`st` is over: the engine keeping its past warm may forget it. A warm request
        still under way is let finish first (its past would be kept after the forget, and
        kept for good), and the forget goes when it has."""
        self._live.pop(id(st), None)
        st.over = True
        if not st.warming:
            self._forget(st)

    def _forget(self, st: Stream) -> None:
        heir = self.view.heir
        if st.warmed and heir is not None and _kept_by(heir) == st.warmed_on:
            st.warmed = 0
            self._spawn(self._post(heir, {"key": st.warm_key, "forget": True}))

    def _spawn(self, coro: Coroutine[Any, Any, object]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _warm(self, heir: Target, st: Stream, past: list[int]) -> None:
        try:
            kept = await self._post(heir, {"key": st.warm_key, "prompt": past})
            if kept:
                st.kept_at[_kept_by(heir)] = len(past)
            if kept and st.warmed_on == _kept_by(heir):
                st.warmed = len(past)
        finally:
            st.warming = False
            if st.over:
                self._forget(st)

    async def _post(self, heir: Target, body: dict[str, object]) -> bool:
        url = f"http://{heir.host}:{heir.port}{PATH}"
        timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
        try:
            async with self.client().post(url, json=body, timeout=timeout) as resp:
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


def _kept_by(engine: Target) -> str:
    """Where a stream's past is kept: the engine, on the model version it runs. A standby
    refitted to new weights has given back what it kept (engine/refit.py), so it is another
    place for the warming."""
    return f"{engine.name}@{engine.version}"


def _prompt_ids(request: dict[str, Any]) -> list[int] | None:
    """A completion request's prompt, if it is one list of token ids."""
    for field in ("prompt_token_ids", "prompt"):
        value = request.get(field)
        if isinstance(value, list) and value and all(type(t) is int for t in value):
            return value
    return None
