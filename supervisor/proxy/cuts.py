"""What becomes of a stream the router relays (supervisor/proxy/relay.py) when a try of it
fails: the client went away, a continuation was refused, or the stream was cut (`CUT`: the
primary died or was fenced, or its term ended). `Cuts.failed` says whether it is retried,
continued on the next primary (its migration counted and told as `migrating`), finished,
handed back to the router that forwarded it, aborted, or ended with an error in OpenAI's
shape. `Flight` is one stream in the relay, `Relayed` what a relay answers."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import structlog
from aiohttp import web

from holdfast_contract.events import EventName as N
from supervisor.primary import LeadershipEnded, Target
from supervisor.proxy.answers import Answer, ClientGone, JsonAnswer, SseAnswer
from supervisor.proxy.migration import Stream, StreamCut
from supervisor.proxy.routing import (
    FORWARDED_BY,
    UPSTREAM_ERRORS,
    Events,
    NotLeader,
    Routes,
    Tally,
    Tries,
    error,
    gave_up,
    not_leader,
)

log = structlog.get_logger("supervisor.router")
BUSY_WAIT_S = 0.01  # a continuation answered 503 (busy) is asked again this much later
CUT = (*UPSTREAM_ERRORS, StreamCut, LeadershipEnded)


@dataclass(frozen=True)
class NotAStream:
    """The engine answered a collected request with something other than an OpenAI stream
    (an error, its own non-streamed body, another format): the request goes again as the
    client sent it, relayed as bytes."""

    why: str


Relayed = web.StreamResponse | NotAStream


class Refused(Exception):
    """A continuation was answered with an error status instead of a stream."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Flight:
    """One request relayed as a stream: its stream so far, its client's answer, its tries."""

    request: web.Request
    st: Stream
    out: Answer
    tries: Tries


@dataclass(frozen=True)
class Cuts:
    """The failed tries of one router's streams: sent again where `routes` says, counted in
    `tally`, their migrations told to `events`."""

    routes: Routes
    tally: Tally
    events: Events

    async def failed(self, f: Flight, e: Exception, target: Target) -> Relayed | Target | None:
        """After a try of `f` failed: the answer to give, where to try next, or None."""
        if isinstance(e, ClientGone):  # (raised by a streamed client's writes only)
            log.info("client went away", stream=True, tokens=len(f.st.emitted))
            return response(f.out)
        if isinstance(e, Refused):
            if e.status == 503 and time.monotonic() < f.tries.deadline:  # busy: ask again
                await asyncio.sleep(BUSY_WAIT_S)
                return target
            f.tries.reason = f"the continuation on {target.name} was refused: {e}"
            return None
        return await self._cut(f, e, target)

    async def _cut(self, f: Flight, e: Exception, target: Target) -> Relayed | Target | None:
        """A try of `f` cut (CUT): retried, migrated, finished, handed back, or given up."""
        if f.out.cut:  # bytes went out under a term that then ended: aborted
            return self._aborted(f)
        ended = isinstance(e, (NotLeader, LeadershipEnded))  # the term, not the engine
        if ended and f.tries.forwarded and not f.out.sent:
            return not_leader()  # the router that sent it goes on on the next leader
        f.tries.reason = f"primary {target.name} failed: {type(e).__name__}"
        if target.remote and (ended and not f.out.opened or f.st.pending and f.st.cut_at):
            # nothing of this try reached the client, and that node's term is over
            # as seen here, or it said so, or it did not take the continuation:
            # the same term again a moment later (it may resume it), or the next
            again = await f.tries.again(target)
            if again is None and f.st.pending:
                f.tries.reason = gave_up(f.tries.reason, self.routes.spec)
            return again
        across = self._across_versions(target)
        if f.st.collect and (not f.st.can_continue() or ended and f.st.complete() or across):
            # no ids: asked again, whole; or all of it came, but its term ended
            # before it left: nothing reached the client, so it is made again; or cut by
            # a refit: made again whole by the new version, never by two
            f.st, f.out = f.st.fresh(), JsonAnswer(f.request, self.routes.view.valid)
        if not f.out.opened or not f.st.wrote:  # nothing came through: a plain retry
            return await f.tries.retry(target)
        if f.st.collect:
            f.st.rewind()  # its client has seen nothing: held-back text is made again
        if f.st.complete():  # the cut came after the last token
            try:
                return await self.finish(f.out, f.st)
            except LeadershipEnded:
                return self._aborted(f)
        if (self.routes.stopping or ended) and f.tries.forwarded:
            return self._hand_back(f)
        why = self._other_version(target) or self._unmigratable(f.st)
        if why:
            f.tries.reason = f"{f.tries.reason}; {why}"
            return None
        self._migrating(f.st, target, f.tries.reason)
        return await f.tries.follow(target)

    def _aborted(self, f: Flight) -> web.StreamResponse:
        """An answer cut because its term ended as it was leaving: the client (or the
        router that forwarded it) sees the connection aborted, and retries."""
        self.tally.broken += 1
        log.warning("answer_cut", why="term ended", path=f.request.path)
        if f.request.transport is not None:
            f.request.transport.abort()
        return response(f.out)

    def _hand_back(self, f: Flight) -> web.StreamResponse:
        """A forwarded stream cut while this node stops or its term ends: the router that
        forwarded it continues it on the next leader from what its own client has seen, so
        it gets a cut (the connection aborted), not an error event it would pass on as the
        end."""
        by = f.request.headers[FORWARDED_BY]
        log.info("stream_handed_back", by=by, tokens=len(f.st.emitted))
        if f.request.transport is not None:
            f.request.transport.abort()
        return response(f.out)

    def _unmigratable(self, st: Stream) -> str:
        spec = self.routes.spec
        if self.routes.stopping:
            return "the supervisor is stopping"
        if not st.can_continue():
            return "the engine's stream carries no token ids (return_token_ids)"
        if st.migrated >= spec.migration_limit:
            return f"router.migration_limit ({spec.migration_limit}) reached"
        return ""

    def _across_versions(self, cut: Target) -> bool:
        """Whether `cut` was cut by a refit that retries what it had in flight on the next
        version (update.refit_inflight: retry), which the router serves now."""
        now = self.routes.view.route()
        return (
            now is not None
            and not cut.remote
            and (cut.version, now.version) in self.routes.view.continues
        )

    def _other_version(self, cut: Target) -> str:
        """Why a stream cut on `cut` is not continued: the router serves another model
        version now (a rolling update), and an answer never mixes versions (unless a refit
        that retries its cut streams cut it: `_across_versions`)."""
        now = self.routes.view.route()
        if now is None or cut.remote or now.version == cut.version or not cut.version:
            return ""
        if self._across_versions(cut):
            return ""
        return (
            f"the model was updated from version {cut.version} to {now.version} while "
            f"this answer was made, and the old version's engine {cut.name} ended before "
            "it was done (update.drain_s); an answer is never continued on another version"
        )

    def _migrating(self, st: Stream, target: Target, reason: str) -> None:
        st.migrated += 1
        st.cut_at = st.last_token_at or time.monotonic()
        st.pending = True
        self.tally.migrations["attempted"] += 1
        # its log line is the event's: a failover cuts every stream at once, and each line
        # logged then delays the continuations
        self.events(
            N.MIGRATING, target.epoch, engine=target.name, tokens=len(st.emitted), why=reason
        )

    def resumed(self, st: Stream, tokens: int) -> None:
        """The first token after a cut reached the client: the stall it saw, and how many
        tokens of its past the engine had kept (`kept`; the rest it computed), from the
        dead primary's KV cache (`continued`: adopted) or warm (kept), or none (replayed)."""
        stall, st.cut_at = st.last_token_at - st.cut_at, 0.0
        how = ("adopted" if st.kv_key else "kept") if st.kept else "replayed"
        self.tally.stalls[how].observe(stall)
        stall_ms = round(stall * 1e3, 2)
        past = len(st.prompt_ids or ()) + tokens  # the continuation's prompt
        self.events(
            N.MIGRATED,
            st.epoch,
            tokens=tokens,
            kept=st.kept,
            prefill=max(0, past - st.kept),
            continued=how,
            stall_ms=stall_ms,
        )

    async def finish(self, out: Answer, st: Stream) -> web.StreamResponse:
        """The end of a stream that came whole (its migration, if any, succeeded)."""
        resp = await out.done(st)
        if st.pending:
            st.pending = False
            self.tally.migrations["succeeded"] += 1
        return resp

    async def end_with_error(self, f: Flight) -> web.StreamResponse:
        """The end of a stream that cannot go on: a 502 (503 while stopping) before any byte
        or to a collected request, else an error event and no [DONE]."""
        st, out, reason = f.st, f.out, f.tries.reason
        self.tally.failed += 1
        log.warning("route_failed", path=f.request.path, error=reason)
        if st.pending:
            st.pending = False
            self.tally.migrations["failed"] += 1
            self.events(N.MIGRATION_FAILED, 0, tokens=len(st.emitted), why=reason)
        if isinstance(out, SseAnswer) and out.opened:
            self.tally.broken += 1
            return await out.failed(reason)
        stopping = self.routes.stopping
        status = 503 if stopping else 502
        return error(status, reason, "unavailable" if stopping else "upstream_error")


def response(out: Answer) -> web.StreamResponse:
    """What a relay ended without an answer of its own returns to aiohttp."""
    return out.resp if isinstance(out, SseAnswer) and out.resp else web.Response()
