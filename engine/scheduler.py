"""Iteration-level scheduling: which requests run in the next model step.

Plain Python, no torch. Each step decodes one token for every running request and, mixed
into the same step, prefills the prompts of requests admitted since the last one, so new
arrivals never stall the running batch (a prompt's first token comes out of the step that
prefills it). Admission is first come,
first served: the head of the waiting queue is admitted when its KV blocks are free and the
batch has room; nothing behind it jumps the queue, so no request starves. A request gets
the blocks for its whole length (prompt + max_tokens) when it is admitted, so a running
request never runs out of cache and is never preempted; a request that ends early gives
its blocks back at once.

A prefix may be kept warm (`warm`): a standby prefills the prompt and tokens so far of a
stream another engine serves, under the stream's key, and keeps their blocks. A
continuation naming that key (`Seq.warm_key`) takes those blocks over and prefills only
the tokens after them (`Seq.cached`), so a promoted standby resumes a migrated stream
without computing its whole past again. Kept prefixes give their blocks back when told
(`forget`), when their continuation takes them, when a request needs the blocks (least
recently warmed first), or after `WARM_TTL_S` unused.

A warm prefill also keeps the step it sampled after the past, and an adopted stream's
past (a dead engine's ledger, engine/kvshare.py) the steps of the last tokens its engine
sampled (`Kept.after`). A continuation whose prompt is that past exactly (its client has
every token the past holds), or the past less a few of those last tokens, computes
nothing: the token sampled after its prompt is its first, sent as it is admitted
(`Plan.ready`), and it decodes from the next step. A promoted engine that adopted a dead
engine's cache prefills each stream's last sampled token, ahead of its continuation
(`Seq.ahead`).
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Callable

import msgspec

from engine.errors import QueueFull
from engine.job import Step
from engine.kvcache import BlockAllocator, blocks_for

_ids = itertools.count()
WARM_TTL_S = 120.0  # a kept prefix no continuation took is dropped after this long
# the tokens of a step of warm pasts whose first is longer than a graph holds (eager anyway)
EAGER_WARM_ROWS = 1024
# the steps of a stream's last tokens the ledger keeps (engine/kvshare.py): a client that
# lacks that many or fewer of what a dead engine sampled gets them with nothing computed
LEDGER_STEPS = 4


class Seq:
    """One request's life in the scheduler."""

    def __init__(
        self,
        prompt: tuple[int, ...],
        max_tokens: int,
        *,
        top_logprobs: int = 0,
        ignore_eos: bool = False,
        cancel: threading.Event | None = None,
        warm_key: str = "",
        warming: bool = False,
        kv_key: str = "",
        ahead: bool = False,
    ) -> None:
        self.id = next(_ids)
        self.prompt, self.max_tokens = prompt, max_tokens
        self.top_logprobs, self.ignore_eos = top_logprobs, ignore_eos
        self.cancel = cancel if cancel is not None else threading.Event()
        self.out: list[Step] = []
        self.blocks: list[int] = []
        self.finish_reason = ""
        # the kept prefix this request takes over (a continuation), or keeps (`warming`:
        # a prefill only, whose blocks are kept under the key when it ends)
        self.warm_key, self.warming = warm_key, warming
        self.kv_key = kv_key  # its stream's key in a shared cache's ledger (engine/kvshare.py)
        # a warm prefill of an adopted stream's past and last token, ahead of its
        # continuation: never gathered with others (it is all that will come)
        self.ahead = ahead
        # a warm prefill's: the steps that sampled its prompt's last tokens, where the past
        # it took over kept them (`Kept.after`)
        self.prior: tuple[Step, ...] = ()
        self.cached = 0  # leading prompt positions whose keys and values are in `blocks`
        self.queued = time.monotonic()

    @property
    def continues(self) -> bool:
        """Whether this is a continuation of a prefix kept here (a migrated stream)."""
        return bool(self.warm_key) and not self.warming

    @property
    def kv_tokens(self) -> int:
        """Positions this request ever writes: the last sampled token is never fed back."""
        return len(self.prompt) + self.max_tokens - 1

    @property
    def fresh(self) -> int:
        """Prompt tokens its prefill computes (those after the kept prefix)."""
        return len(self.prompt) - self.cached

    @property
    def position(self) -> int:
        """Position of the token fed in the next decode step (the last one sampled)."""
        return len(self.prompt) + len(self.out) - 1

    @property
    def last_token(self) -> int:
        return self.out[-1].token


class Kept(msgspec.Struct):
    """A warm prefix: its tokens, the blocks holding their keys and values, when last used;
    and the steps that sampled its last `len(after) - 1` tokens and the one after them
    (`after[-1]`), with the top alternatives asked for then."""

    tokens: tuple[int, ...]
    blocks: list[int]
    used: float
    after: tuple[Step, ...] = ()

    def first_of(self, seq: Seq) -> Step | None:
        """`seq`'s first token, if it was sampled already: `seq`'s prompt is the past, or
        the past less a few last tokens whose steps are kept (`after`), and it asks no
        more alternatives than were kept."""
        n, k, m = len(self.tokens), len(self.after), len(seq.prompt)
        if not (k and max(1, n - k + 1) <= m <= n and seq.prompt == self.tokens[:m]):
            return None
        step = self.after[m - (n - k + 1)]
        if seq.top_logprobs > len(step.top):
            return None
        return msgspec.structs.replace(step, top=step.top[: seq.top_logprobs])


class Plan(msgspec.Struct, frozen=True):
    """One step: prompts to prefill (newly admitted) and requests to decode (running);
    and, computed already, the first token of continuations admitted with nothing to
    compute (`Kept.first_of`): out before the step, decoding from the next one."""

    prefill: tuple[Seq, ...] = ()
    decode: tuple[Seq, ...] = ()
    ready: tuple[tuple[Seq, Step], ...] = ()

    @property
    def seqs(self) -> tuple[Seq, ...]:
        """In the order of the step's outputs: prompts first."""
        return self.prefill + self.decode


def _rows_beside(first: Seq, head: Seq, graph_rows: int) -> int:
    """The tokens a step whose first prefill is `first` may hold with `head` in it: a
    graph's rows, or, for warm pasts beside a first that runs eagerly anyway (longer than
    a graph holds), EAGER_WARM_ROWS: a heir refitted to new weights, or newly named, gets
    every stream's whole past at once, and one past a step would be as many eager passes
    (16 of ~300 tokens: 0.8 s on an H100 beside a primary decoding)."""
    if first.warming and head.warming and first.fresh > graph_rows:
        return max(graph_rows, EAGER_WARM_ROWS)
    return graph_rows


class Scheduler:
    def __init__(
        self,
        allocator: BlockAllocator,
        eos: frozenset[int],
        *,
        block_size: int,
        max_running: int,
        max_waiting: int,
        prefill_tokens: int,
    ) -> None:
        self.allocator, self.eos, self.block_size = allocator, eos, block_size
        self.max_running, self.max_waiting = max_running, max_waiting
        self.prefill_tokens = prefill_tokens
        self.waiting: collections.deque[Seq] = collections.deque()
        self.running: list[Seq] = []
        self.kept: collections.OrderedDict[str, Kept] = collections.OrderedDict()

    def add(self, seq: Seq) -> None:
        if len(self.waiting) >= self.max_waiting:
            raise QueueFull(
                f"{len(self.waiting)} requests already wait for the KV cache "
                f"(the engine's --max-waiting); retry later"
            )
        if seq.warm_key and not seq.warming:  # its past is what it brings: keep no more of it
            for other in self.waiting:  # (but one it waits for: `held_back`)
                mine = other.warming and other.warm_key == seq.warm_key
                if mine and not (other.ahead and other.prompt == seq.prompt):
                    other.cancel.set()
        self.waiting.append(seq)

    def fits_ever(self, tokens: int) -> bool:
        return blocks_for(tokens, self.block_size) <= self.allocator.total

    def reap(self, on_done: Callable[[Seq], None]) -> None:
        """End every request whose client left, waiting or running; free its blocks."""
        for seq in [s for s in self.waiting if s.cancel.is_set()]:
            self.waiting.remove(seq)
            self._finish(seq, "cancelled", on_done)
        for seq in [s for s in self.running if s.cancel.is_set()]:
            self._finish(seq, "cancelled", on_done)

    def plan(self, graph_rows: int = 0) -> Plan | None:
        """Every running request decodes; new prompts join as KV blocks and the prefill
        budget allow, in arrival order. Continuations go first, and alone: a step with a
        migrated stream's few fresh tokens takes no whole prompt (a request's, a warm
        past's) beside them, which would make it a long prefill for the streams a client
        is waiting on; the prompts join the next step.

        A continuation or a warm prefill joins a step only while the step's tokens stay
        within `graph_rows` (0: no bound but the prefill budget), unless it is the step's
        first: the runner passes its largest captured graph's rows. (A step whose first
        warm past is longer than that, eager anyway, takes more warm pasts up to
        EAGER_WARM_ROWS tokens.) A standby's warm step
        is then one replay, and a continuation arriving while it runs (the standby just
        promoted) waits for that, not for an eager pass over many pasts; continuations with
        more fresh tokens than one graph holds run as two replays (6-9 ms each on an H200
        with llama-8b), not as one eager step (26 ms for 16 streams' 163 tokens)."""
        decode = tuple(self.running)
        admitted: list[Seq] = []
        ready: list[tuple[Seq, Step]] = []
        budget = self.prefill_tokens
        rows = len(decode)
        self._expire(time.monotonic())
        aheads = self.aheads()
        free = [seq for seq in self.waiting if not held_back(seq, aheads)]
        # (an adopted stream's last token, `ahead`, is one token: it goes with them)
        queue = [seq for seq in free if seq.continues or seq.ahead] or free
        for head in queue:
            if len(self.running) + len(admitted) >= self.max_running:
                break
            kept = self._kept_for(head)
            first = kept.first_of(head) if kept is not None else None
            if first is not None:
                if not self._admit(head, kept, len(head.prompt)):
                    break
                self.running.append(head)  # decodes from the next step
                ready.append((head, first))
                continue
            cached = kept_len(kept, head) if kept is not None else 0
            fresh = len(head.prompt) - cached
            if admitted and fresh > budget:
                break
            if (
                admitted
                and head.warm_key
                and graph_rows
                and rows + fresh > _rows_beside(admitted[0], head, graph_rows)
            ):
                break
            if not self._admit(head, kept, cached):
                break
            admitted.append(head)
            budget -= head.fresh
            rows += head.fresh
        self.running.extend(admitted)
        if not admitted and not decode and not ready:
            return None
        return Plan(tuple(admitted), decode, tuple(ready))

    def _admit(self, head: Seq, kept: Kept | None, cached: int) -> bool:
        """`head` out of the queue with blocks for all it writes: `kept`'s (its first
        `cached` positions computed already) and free ones; False (nothing done) if they
        are not free."""
        need = blocks_for(head.kv_tokens, self.block_size) - (len(kept.blocks) if kept else 0)
        if need > self.allocator.free:
            self._evict(need, keep=head.warm_key)
            if need > self.allocator.free:
                return False
        self.waiting.remove(head)
        if kept is not None:
            del self.kept[head.warm_key]
            head.blocks, head.cached = kept.blocks, cached
            last = kept.after[-1].token if kept.after else None
            if head.warming and last == head.prompt[-1] and kept.tokens == head.prompt[:-1]:
                head.prior = kept.after  # its prompt is the past and the token after it
            if need < 0:  # kept past what this request writes: the rest back
                self.allocator.give_back(head.blocks[need:])
                head.blocks = head.blocks[:need]
        head.blocks = head.blocks + self.allocator.take(max(0, need))
        return True

    # ---- kept prefixes ----
    def forget(self, key: str) -> bool:
        """Give back the blocks kept under `key` and cancel a prefill that would keep
        more; whether any were kept."""
        for seq in (*self.waiting, *self.running):
            if seq.warming and seq.warm_key == key:
                seq.cancel.set()
        return self._release(key)

    def forget_all(self) -> None:
        """Give back every kept prefix and cancel every prefill that would keep one (their
        keys and values were made by weights now replaced)."""
        for seq in (*self.waiting, *self.running):
            if seq.warming:
                seq.cancel.set()
        for key in list(self.kept):
            self._release(key)

    def _release(self, key: str) -> bool:
        kept = self.kept.pop(key, None)
        if kept is not None:
            self.allocator.give_back(kept.blocks)
        return kept is not None

    def ledger(self) -> list[tuple[str, list[int], list[int], list[Step]]]:
        """For each running request with a stream key: the key, the ids of the positions
        whose keys and values are complete (all but its last sampled token), its blocks,
        and the steps of its last LEDGER_STEPS tokens sampled (that one's the last)."""
        out = []
        for seq in self.running:
            if seq.kv_key and seq.out:
                done = seq.position
                past = [*seq.prompt[:done], *(s.token for s in seq.out[: done - len(seq.prompt)])]
                out.append((seq.kv_key, past, list(seq.blocks), seq.out[-LEDGER_STEPS:]))
        return out

    def adopt(self, entries: list[tuple[str, list[int], list[int], list[Step]]]) -> None:
        """Keep each (key, tokens, blocks, the steps of its last tokens sampled) of a dead
        engine's ledger as a prefix for its stream's continuation; their blocks are taken
        from the free list."""
        now = time.monotonic()
        for key, tokens, blocks, recent in entries:
            self.allocator.reserve(blocks)
            self.kept[key] = Kept(tuple(tokens), list(blocks), now, tuple(recent))

    @property
    def kept_blocks(self) -> int:
        return sum(len(k.blocks) for k in self.kept.values())

    def aheads(self) -> dict[str, tuple[Seq, bool]]:
        """The prefills of adopted streams' last tokens (`Seq.ahead`) not cancelled, by
        key, and whether each runs (see `held_back`)."""
        out = {seq.warm_key: (seq, False) for seq in self.waiting if seq.ahead}
        out |= {seq.warm_key: (seq, True) for seq in self.running if seq.ahead}
        return {k: v for k, v in out.items() if not v[0].cancel.is_set()}

    def has_first(self, seq: Seq) -> bool:
        """Whether `seq` would be admitted with its first token computed already."""
        kept = self.kept.get(seq.warm_key) if seq.continues else None
        return kept is not None and kept.first_of(seq) is not None

    def _kept_for(self, seq: Seq) -> Kept | None:
        """The prefix kept under the request's key, if it and the prompt agree as far as
        both go (an adopted stream's keys and values may run past what its client was
        sent: the continuation overwrites them)."""
        kept = self.kept.get(seq.warm_key) if seq.warm_key else None
        n = min(len(kept.tokens), len(seq.prompt)) if kept is not None else 0
        if kept is None or seq.prompt[:n] != kept.tokens[:n]:
            if kept is not None:  # another past under this key: of no use to anyone now
                self._release(seq.warm_key)
            return None
        return kept

    def _evict(self, need: int, keep: str) -> None:
        """Free kept prefixes, least recently warmed first, until `need` blocks are free."""
        for key in [k for k in self.kept if k != keep]:
            if self.allocator.free >= need:
                return
            self._release(key)

    def _expire(self, now: float) -> None:
        while self.kept:
            key, kept = next(iter(self.kept.items()))
            if now - kept.used < WARM_TTL_S:
                return
            self._release(key)

    def record(self, plan: Plan, sampled: list[Step], on_done: Callable[[Seq], None]) -> None:
        """Append each request's new token; end those that hit EOS or max_tokens."""
        for seq, s in zip(plan.seqs, sampled, strict=True):
            seq.out.append(s)
            if s.token in self.eos and not seq.ignore_eos:
                self._finish(seq, "stop", on_done)
            elif len(seq.out) >= seq.max_tokens:
                self._finish(seq, "length", on_done)

    def abort_all(self, reason: str, on_done: Callable[[Seq], None]) -> None:
        for seq in list(self.waiting):
            self.waiting.remove(seq)
            self._finish(seq, reason, on_done)
        for seq in list(self.running):
            self._finish(seq, reason, on_done)

    def abort_running(self, reason: str, on_done: Callable[[Seq], None]) -> None:
        """End every running request (their blocks' cache is going); those waiting stay."""
        for seq in list(self.running):
            self._finish(seq, reason, on_done)

    def drop(self, seq: Seq) -> None:
        """Take a request out of the running batch and give its blocks back."""
        if seq in self.running:
            self.running.remove(seq)
        self.allocator.give_back(seq.blocks)
        seq.blocks = []

    def _finish(self, seq: Seq, reason: str, on_done: Callable[[Seq], None]) -> None:
        seq.finish_reason = reason
        if seq.warming and reason != "cancelled" and seq in self.running:
            self.running.remove(seq)  # its blocks are kept, not given back
            self._release(seq.warm_key)
            keep = blocks_for(len(seq.prompt), self.block_size)
            self.allocator.give_back(seq.blocks[keep:])
            after = (*seq.prior, *seq.out[:1])[-LEDGER_STEPS - 1 :]
            now = time.monotonic()
            self.kept[seq.warm_key] = Kept(seq.prompt, seq.blocks[:keep], now, after)
            seq.blocks = []
        else:
            self.drop(seq)
        on_done(seq)


def held_back(seq: Seq, aheads: dict[str, tuple[Seq, bool]]) -> bool:
    """Whether continuation `seq` waits for the prefill of its adopted stream's last token
    (`Scheduler.aheads`): one running (it holds the past's blocks until it ends), or one
    queued of the very prompt `seq` has (after it `seq` computes nothing)."""
    ahead = aheads.get(seq.warm_key) if seq.continues else None
    return ahead is not None and (ahead[1] or ahead[0].prompt == seq.prompt)


def kept_len(kept: Kept, seq: Seq) -> int:
    """Prompt positions of `seq` a kept prefix covers: all its tokens, less the prompt's
    last, which the prefill must compute to sample what follows it."""
    return min(len(kept.tokens), len(seq.prompt) - 1)
