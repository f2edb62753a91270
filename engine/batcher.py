"""The engine loop: continuous batching on one model thread.

`submit` (any thread) queues a request and returns a future; the loop thread asks the
scheduler for the next step, runs it on every rank through the runner, and hands each
request its new token. Between steps requests join (admitted as KV blocks free up) and
leave (EOS, max_tokens, or their client left), so the batch changes at every step.
When there is no work the loop captures the next CUDA graph, if one is left (see
`engine.graphs`), or sleeps until a request arrives; under non-stop load it captures one
every `CAPTURE_EVERY` steps, so a step waits for at most one capture (about 50 ms on an
H200) now and then until every graph exists.

Continuations arrive together: when a primary dies, the router sends every cut stream's
continuation to the promoted engine within a few milliseconds. Stepping at the first one
would run it alone and the others a whole step later, so while continuations are still
arriving (the last less than `GATHER_QUIET_S` ago) the loop waits, at most `GATHER_MAX_S`
after the first, and they prefill in one step.

Warm prefills (a standby keeping streams' pasts, `warm`) arrive the same way: the router
sends the pasts of many streams at once (supervisor/proxy/warming.py), and each step of a
standby reads the weights as a decode step of the primary beside it does. So while warm
prefills are all a standby has to run, it gathers them the same way, into one step.

Callbacks for one step's tokens go out together through `post` (the server passes
`loop.call_soon_threadsafe`), so a step of 128 requests costs the event loop one wakeup.
They go out once the next step is queued on the device (or the loop has nothing left to
run) when that step is a graph replay: the event loop streams step N's tokens while the
GPU computes step N+1, instead of taking the GIL from the model thread while it prepares
that step. When step N+1 runs eagerly (a long prefill, whose launches alone take tens of
ms on a large model), and on the CPU, where a step computes as it is called, they go out
as step N+1 begins (`Runner.step`), not after its launch.
"""

from __future__ import annotations

import concurrent.futures
import os
import sys
import threading
import time
from collections.abc import Callable

import msgspec
import structlog
import torch

from engine.errors import BadRequest, EngineError, QueueFull
from engine.job import TOP_LOGPROBS_MAX, Generation, Job, OnStep, Stats, Step
from engine.kvcache import BlockAllocator, KVCache, blocks_for
from engine.kvshare import Adopted, Entry, Home, SharedKV, wait_exited
from engine.runner import Runner
from engine.scheduler import Plan, Scheduler, Seq, held_back

log = structlog.get_logger("engine.batcher")
Post = Callable[[Callable[[], None]], object]
SWITCH_INTERVAL_S = 0.0002
CAPTURE_EVERY = 64  # steps: under non-stop load, still capture a graph now and then
GATHER_QUIET_S = 0.002  # continuations this far apart come in one step...
GATHER_MAX_S = 0.010  # ...which waits at most this long for them
HELD_WAIT_S = 60.0  # a dead engine's blocks are kept from use until it exits, this long at most


class Request:
    def __init__(self, seq: Seq, on_step: OnStep | None) -> None:
        self.seq, self.on_step = seq, on_step
        self.future: concurrent.futures.Future[Generation] = concurrent.futures.Future()


class BatchEngine:
    kind = "generate"

    def __init__(self, runner: Runner, scheduler: Scheduler) -> None:
        self.runner, self.scheduler = runner, scheduler
        self.post: Post = lambda fn: fn()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._requests: dict[int, Request] = {}
        self._step_ms, self._steps = 0.0, 0
        self._reused = 0  # prompt tokens a kept prefix spared a step
        self._pending: list[Callable[[], None]] = []  # the last step's callbacks, not yet out
        self._calls: list[tuple[Callable[[], None], concurrent.futures.Future[None], bool]] = []
        self._thread = threading.Thread(target=self._loop, name="model", daemon=True)
        # a cache shared with the keeper: its ledger is written after every step, and
        # before one that writes blocks it does not name (`_covered`)
        self.shared: SharedKV | None = None
        self._covered: set[int] = set()
        self.home: Home | None = None  # where it is kept (a standby's: once promoted)
        # the usable blocks of a cache acknowledged but not swapped in yet (a promotion's):
        # what a request arriving meanwhile is admitted against; no step runs while set
        self._blocks_ahead: int | None = None

    def start(self) -> None:
        # The model thread needs the GIL back at once after each step's device sync; the
        # default 5 ms switch interval would let the HTTP thread hold the GPU idle.
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        self._thread.start()
        if self.home is not None and self.shared is None:  # a standby: until promoted
            self.home.hold_ahead()

    def submit(
        self, job: Job, on_step: OnStep | None = None, cancel: threading.Event | None = None
    ) -> concurrent.futures.Future[Generation]:
        """Queue a request (raises QueueFull past the waiting bound); its future completes
        when it ends. `on_step` gets each token, through `post`."""
        seq = Seq(
            job.prompt,
            job.max_tokens,
            top_logprobs=job.top_logprobs,
            ignore_eos=job.ignore_eos,
            cancel=cancel,
            warm_key=job.warm_key if self.warms else "",
            kv_key=job.kv_key if self.shared is not None else "",
        )
        return self._queue(seq, on_step)

    @property
    def warms(self) -> bool:
        """Whether this engine keeps prefixes warm (one rank: a continued prompt's tokens
        take rows the other ranks could not place)."""
        return self.runner.tp.size == 1

    def warm(self, key: str, prompt: tuple[int, ...]) -> concurrent.futures.Future[Generation]:
        """Prefill `prompt` and keep its keys and values under `key` for a continuation of
        it (only the tokens after what `key` already keeps are computed)."""
        if not self.warms:
            raise BadRequest("this engine runs tensor parallel and keeps no prefix warm")
        seq = Seq(prompt, 1, ignore_eos=True, warm_key=key, warming=True)
        return self._queue(seq, None)

    def forget(self, key: str) -> bool:
        """Give back what is kept under `key`; whether anything was."""
        with self._lock:
            return self.scheduler.forget(key)

    def _queue(self, seq: Seq, on_step: OnStep | None) -> concurrent.futures.Future[Generation]:
        if not self._fits_ever(seq.kv_tokens):
            raise BadRequest(
                f"prompt ({len(seq.prompt)} tokens) + `max_tokens` ({seq.max_tokens}) needs "
                f"more KV cache than this engine has ({self.runner.cache.tokens} tokens); "
                "shorten the prompt or lower max_tokens (or raise the engine's --kv-cache-mb)"
            )
        request = Request(seq, on_step)
        with self._lock:
            if self._stopping:
                raise EngineError("the engine loop has stopped")
            self.scheduler.add(seq)
            self._requests[seq.id] = request
        self._wake.set()
        return request.future

    @property
    def kv_pending(self) -> bool:
        """Whether a promotion's KV cache is on its way (no step runs until it is in)."""
        with self._lock:
            return self._blocks_ahead is not None

    def _fits_ever(self, tokens: int) -> bool:
        """Whether `tokens` fit the cache served from, or the one about to be."""
        with self._lock:
            ahead = self._blocks_ahead
        if ahead is not None:
            return blocks_for(tokens, self.scheduler.block_size) <= ahead
        return self.scheduler.fits_ever(tokens)

    def run(
        self, job: Job, on_step: OnStep | None = None, cancel: threading.Event | None = None
    ) -> Generation:
        """Blocking form of submit, for callers on their own thread."""
        return self.submit(job, on_step, cancel).result()

    def wake(self) -> None:
        self._wake.set()

    def stats(self) -> Stats:
        s = self.scheduler
        with self._lock:
            return Stats(
                len(s.running),
                len(s.waiting),
                s.allocator.used,
                s.allocator.free,
                s.max_running,
                round(self._step_ms, 3),
                self._steps,
                len(s.kept),
                s.kept_blocks,
                self._reused,
            )

    def embed(self, batch: list[list[int]]) -> list[list[float]]:
        return self.runner.embed(batch)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The model's parameters and buffers by name (views of the pool when attached)."""
        m = self.runner.model
        return {**dict(m.named_parameters()), **dict(m.named_buffers())}

    def between_steps(
        self, fn: Callable[[], None], *, forget: bool = True
    ) -> concurrent.futures.Future[None]:
        """Run `fn` on the model thread before its next step or graph capture (a refit's
        swap); the future ends with it. With `forget`, what is kept warm is given back
        after it: its keys and values were computed from the weights before."""
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._lock:
            if self._stopping:
                raise EngineError("the engine loop has stopped")
            self._calls.append((fn, done, forget))
        self._wake.set()
        return done

    def promoted_cache(self, dead: str, ident: str = "") -> tuple[int | None, str]:
        """Promoted: a standby of a shared cache (`home`) serves from the one `dead` (a
        dead primary's key in the keeper, "" for none; `ident`: which cache the keeper
        held there, `Promote.kv_ident`) left, adopted, or else a fresh one of its own,
        from the next step on. The streams taken over (None: none, and why; None and "":
        not asked).

        Only the checks are waited for here (the keeper's fds, the ledger, the writer's
        death). The swap, and on a GPU the mapping into the engine's range, run on the
        model thread while the router's continuations (sent once this returns) are on
        their way: they are admitted against the cache to come and say what it keeps of
        them. On a GPU the standby's own pages are unmapped there while the checks are
        made. From the call on, no step or graph capture runs until the swap (`_loop`)."""
        if self.home is None or self.shared is not None:
            why = "this engine keeps its KV cache private" if dead and self.home is None else ""
            return None, why
        home = self.home
        t0 = time.perf_counter()
        with self._lock:  # from now on no step runs until the swap
            self._blocks_ahead = home.layout.blocks
        space = home.space
        if space is not None:  # the standby's own pages go on the model thread meanwhile
            self.between_steps(space.unmap, forget=False)
        try:
            if dead:
                claimed, why = home.claim(dead, ident)
            else:
                claimed, why = None, ""
                home.let_go()
        except Exception as e:  # whatever it is, the engine serves from a cache of its own
            log.exception("kv cache not claimed", dead=dead)
            claimed, why = None, f"its claim failed: {e}"

        def swap() -> None:
            t1 = time.perf_counter()
            try:
                took, late = home.place(claimed, why)
                if late and not why:  # the router was told they were adopted: they prefill
                    log.warning("kv cache not mapped after the promotion's ack", why=late)
                with self._lock:
                    self._swap(home.cache(took.shared), took)
            except BaseException:  # no cache to serve from, and no step runs until there
                # is one: exit, so the supervisor sees a death, not a primary that hangs
                log.critical("no KV cache can be served from; exiting", exc_info=True)
                os._exit(3)
            self._in_use(home, took, dead, t0, t1)

        self.between_steps(swap, forget=False)
        if why or not dead:
            return None, why
        assert claimed is not None
        return len(claimed.entries), ""

    def _in_use(self, home: Home, took: Adopted, dead: str, t0: float, t1: float) -> None:
        """The cache is served from: into the keeper beside serving (the router waits for
        the promotion, not for this)."""
        threading.Thread(
            target=lambda: home.deposit(took.shared, primary=True), name="kv-deposit", daemon=True
        ).start()
        log.info(
            "kv cache in use",
            dead=dead,
            streams=len(took.entries),
            take_ms=round((t1 - t0) * 1e3, 2),
            swap_ms=round((time.perf_counter() - t1) * 1e3, 2),
        )

    def take_cache(self, cache: KVCache, took: Adopted) -> concurrent.futures.Future[None]:
        """Serve from `cache` (a shared one: adopted from a dead engine, with its ledger's
        entries kept for their streams' continuations, or a fresh one) from the next
        step on. What ran on the cache before (a standby's probe) ends as cancelled. An
        idle engine (nothing running or waiting: no step can be under way) swaps here at
        once, not after a wake-up of the model thread. The blocks the dead engine's last
        step may still write are handed out once it has exited (`release_held`)."""

        with self._lock:
            if not self.scheduler.running and not self.scheduler.waiting:
                self._swap(cache, took)
                done: concurrent.futures.Future[None] = concurrent.futures.Future()
                done.set_result(None)
                return done

        def between() -> None:
            with self._lock:
                self._swap(cache, took)

        return self.between_steps(between, forget=False)

    def _swap(self, cache: KVCache, took: Adopted) -> None:
        """`take_cache`'s swap, under the lock. What runs on the cache before ends as
        cancelled; what waits (a continuation sent on the promotion's ack) runs on the new
        one."""
        self.scheduler.abort_running("cancelled", self._done_now)
        self.scheduler.forget_all()
        self.runner.cache = cache
        self.scheduler.allocator = BlockAllocator(cache.usable)
        self.scheduler.adopt([(e.key, e.tokens, e.blocks, e.recent) for e in took.entries])
        self.scheduler.allocator.reserve(took.held)
        self._ahead(took.entries)
        self.shared = took.shared
        self._covered = set()
        self._blocks_ahead = None
        if took.held:
            threading.Thread(
                target=self.release_held,
                args=(self.scheduler.allocator, took.held, took.writer),
                name="kv-held",
                daemon=True,
            ).start()

    def _ahead(self, entries: list[Entry]) -> None:
        """Each adopted stream's last sampled token (`Entry.sampled`) prefilled now, in one
        step, under its key, ahead of its continuation: one that comes with exactly that
        past computes nothing (engine/scheduler.py `Kept.after`); one that comes before the
        step ends (or came before the swap) waits for it (`scheduler.held_back`). Under
        the lock."""
        for e in entries:
            if e.sampled is None:
                continue
            seq = Seq(
                (*e.tokens, e.sampled.token),
                1,
                top_logprobs=TOP_LOGPROBS_MAX,
                ignore_eos=True,
                warm_key=e.key,
                warming=True,
                ahead=True,
            )
            try:
                self.scheduler.add(seq)
            except QueueFull:  # the queue is at its bound: the rest compute their last token
                break
            self._requests[seq.id] = Request(seq, None)
        self._wake.set()

    def release_held(
        self, allocator: BlockAllocator, held: list[int], writer: tuple[int, int | None]
    ) -> None:
        """Give `held` back to `allocator` once `writer` has exited (its device context
        gone with it); never while it may run."""
        if not wait_exited(writer, HELD_WAIT_S):
            log.warning("kv blocks kept from use: their writer has not exited", pid=writer[0])
            return

        def back() -> None:
            with self._lock:
                if self.scheduler.allocator is allocator:
                    allocator.give_back(held)

        self.between_steps(back, forget=False)
        log.info("kv blocks held for a dead engine's last step given back", blocks=len(held))

    def follow(self) -> int:
        return self.runner.follow()

    def stop_followers(self) -> None:
        """Stop the loop (requests still queued end as cancelled), then the other ranks."""
        with self._lock:
            self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join()
        self.runner.stop_followers()

    # ---- the loop thread ----
    def _loop(self) -> None:
        while True:
            self._run_calls()
            with self._lock:
                if self._stopping:
                    self._flush()
                    self.scheduler.abort_all("cancelled", self._done_now)
                    return
                if self._calls:  # queued since they ran (a promotion's swap): first
                    continue
                swapping = self._blocks_ahead is not None
                if not swapping:
                    self.scheduler.reap(self._done_now)
                    gather = self._gathering()
                    plan = None if gather else self.scheduler.plan(self.runner.graph_rows)
                    if plan is not None and plan.ready:
                        self._first(plan.ready)
            if swapping:  # a promotion's cache is on its way: nothing runs on this one
                self._flush()
                self._wake.wait()
                self._wake.clear()
                continue
            if gather:
                self._flush()
                self._wake.wait(gather)
                self._wake.clear()
                continue
            if plan is not None and not plan.seqs:  # only continuations' first tokens
                self._flush()
                continue
            if plan is None:
                self._flush()
                if not self.runner.capture_next():
                    self._wake.wait()
                self._wake.clear()
                continue
            self._step(plan)
            if self._steps % CAPTURE_EVERY == 0:
                self.runner.capture_next()

    def _run_calls(self) -> None:
        with self._lock:
            calls, self._calls = self._calls, []
        for fn, done, forget in calls:
            try:
                fn()
            except BaseException as e:  # the caller learns of it; the loop goes on
                done.set_exception(e)
                continue
            if forget:
                with self._lock:
                    self.scheduler.forget_all()
                    if self.shared is not None:  # nothing of the weights before is adopted
                        self._write_ledger([])
            done.set_result(None)

    def _first(self, ready: tuple[tuple[Seq, Step], ...]) -> None:
        """Continuations admitted with their first token computed already: it goes out
        now, before any step (they decode from the next). Under the lock."""
        out: list[Callable[[], None]] = []
        seqs = tuple(seq for seq, _ in ready)
        for seq, step in ready:
            self._tell(out, seq, step)

        def done(seq: Seq) -> None:
            out.append(self._finisher(seq))

        self.scheduler.record(Plan(decode=seqs), [step for _, step in ready], done)
        self._reused += sum(seq.cached for seq in seqs)
        if self.shared is not None:  # they run: the ledger names them from now on
            self._write_ledger([Entry(*e) for e in self.scheduler.ledger()])
        self._pending += out
        log.info(
            "continued",
            streams=len(seqs),
            kept=sum(seq.cached for seq in seqs),
            fresh=0,
            ready=len(seqs),  # their first token was computed ahead: no step for it
            waited_ms=round((time.monotonic() - min(seq.queued for seq in seqs)) * 1e3, 1),
        )

    def _gathering(self) -> float:
        """Seconds to wait for more of what arrives together before the next step (0: step
        now): continuations (but those whose first token is computed already), or warm
        prefills while they are all there is to run (but an adopted stream's, `_ahead`,
        which come all at once)."""
        s = self.scheduler
        aheads = s.aheads()
        queued = [
            seq.queued
            for seq in s.waiting
            if seq.continues and not s.has_first(seq) and not held_back(seq, aheads)
        ]
        if not queued and not s.running and all(seq.warming and not seq.ahead for seq in s.waiting):
            queued = [seq.queued for seq in s.waiting]
        if not queued:
            return 0.0
        until = min(max(queued) + GATHER_QUIET_S, min(queued) + GATHER_MAX_S)
        return max(0.0, until - time.monotonic())

    def _step(self, plan: Plan) -> None:
        t0, t0_wall = time.perf_counter(), time.monotonic()
        if self.shared is not None and any(
            b not in self._covered for seq in plan.seqs for b in seq.blocks
        ):  # the ledger names every block this step writes before it starts
            with self._lock:
                self._write_ledger([Entry(*e) for e in self.scheduler.ledger()], plan)
        try:
            steps = self.runner.step(plan, launched=self._flush)
        except Exception as e:  # a bug in a step fails its requests, not the engine
            log.exception("step failed", requests=len(plan.seqs), prefill=len(plan.prefill))
            self._fail(plan, e)
            return
        out: list[Callable[[], None]] = []
        with self._lock:
            for seq, step in zip(plan.seqs, steps, strict=True):
                self._tell(out, seq, step)
            self.scheduler.record(plan, steps, lambda seq: out.append(self._finisher(seq)))
            if self.shared is not None:  # the step's keys and values are written: say so
                self._write_ledger([Entry(*e) for e in self.scheduler.ledger()])
            self._step_ms = (time.perf_counter() - t0) * 1e3
            self._steps += 1
            self._reused += sum(seq.cached for seq in plan.prefill if not seq.ahead)
        self._pending += out  # out with the next step's launch, or when the loop idles
        ahead = sum(seq.ahead for seq in plan.prefill)
        if ahead:  # an adoption's step: its continuations' first tokens come out of it
            log.info("adopted last tokens", streams=ahead, step_ms=round(self._step_ms, 1))
        continued = [seq for seq in plan.prefill if seq.continues]
        if continued:  # a failover's cost on this engine, for whoever reads its log
            log.info(
                "continued",
                streams=len(continued),
                kept=sum(seq.cached for seq in continued),
                fresh=sum(seq.fresh for seq in continued),
                beside=len(plan.seqs) - len(continued),
                waited_ms=round((t0_wall - min(seq.queued for seq in continued)) * 1e3, 1),
                step_ms=round(self._step_ms, 1),
            )

    def _write_ledger(self, entries: list[Entry], plan: Plan | None = None) -> None:
        """The ledger: `entries`, and as held every block of a running request (and of
        `plan`'s, about to run). Under the lock."""
        assert self.shared is not None
        held = {b for seq in self.scheduler.running for b in seq.blocks}
        if plan is not None:
            held.update(b for seq in plan.seqs for b in seq.blocks)
        if self.shared.write(entries, sorted(held)):
            self._covered = held
        else:
            log.warning("kv ledger not written: it does not fit", streams=len(entries))

    def _flush(self) -> None:
        """Post the callbacks held back from the last step (before anything else is posted,
        so a request's tokens always come before its end)."""
        if self._pending:
            out, self._pending = self._pending, []
            self.post(lambda: _run_all(out))

    def _tell(self, out: list[Callable[[], None]], seq: Seq, step: Step) -> None:
        on_step = self._requests[seq.id].on_step
        if on_step is None:
            return
        if seq.continues and not seq.out:  # its first: what its kept past spared
            step = msgspec.structs.replace(step, kept=seq.cached)
        out.append(lambda: on_step(step))

    def _finisher(self, seq: Seq) -> Callable[[], None]:
        request = self._requests.pop(seq.id)
        gen = Generation(len(seq.prompt), tuple(seq.out), seq.finish_reason)
        return lambda: request.future.set_result(gen)

    def _done_now(self, seq: Seq) -> None:
        finish = self._finisher(seq)
        self._flush()
        self.post(finish)

    def _fail(self, plan: Plan, error: Exception) -> None:
        self._flush()
        with self._lock:
            for seq in plan.seqs:
                self.scheduler.drop(seq)
                request = self._requests.pop(seq.id, None)
                if request is not None:
                    request.future.set_exception(error)


def _run_all(fns: list[Callable[[], None]]) -> None:
    for fn in fns:
        fn()
