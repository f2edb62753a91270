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
"""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Callable

import msgspec

from engine.errors import QueueFull
from engine.job import Step
from engine.kvcache import BlockPool, blocks_for

_ids = itertools.count()


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
    ) -> None:
        self.id = next(_ids)
        self.prompt, self.max_tokens = prompt, max_tokens
        self.top_logprobs, self.ignore_eos = top_logprobs, ignore_eos
        self.cancel = cancel if cancel is not None else threading.Event()
        self.out: list[Step] = []
        self.blocks: list[int] = []
        self.finish_reason = ""

    @property
    def kv_tokens(self) -> int:
        """Positions this request ever writes: the last sampled token is never fed back."""
        return len(self.prompt) + self.max_tokens - 1

    @property
    def position(self) -> int:
        """Position of the token fed in the next decode step (the last one sampled)."""
        return len(self.prompt) + len(self.out) - 1

    @property
    def last_token(self) -> int:
        return self.out[-1].token


class Plan(msgspec.Struct, frozen=True):
    """One step: prompts to prefill (newly admitted) and requests to decode (running)."""

    prefill: tuple[Seq, ...] = ()
    decode: tuple[Seq, ...] = ()

    @property
    def seqs(self) -> tuple[Seq, ...]:
        """In the order of the step's outputs: prompts first."""
        return self.prefill + self.decode


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        eos: frozenset[int],
        *,
        block_size: int,
        max_running: int,
        max_waiting: int,
        prefill_tokens: int,
    ) -> None:
        self.pool, self.eos, self.block_size = pool, eos, block_size
        self.max_running, self.max_waiting = max_running, max_waiting
        self.prefill_tokens = prefill_tokens
        self.waiting: collections.deque[Seq] = collections.deque()
        self.running: list[Seq] = []

    def add(self, seq: Seq) -> None:
        if len(self.waiting) >= self.max_waiting:
            raise QueueFull(
                f"{len(self.waiting)} requests already wait for the KV cache "
                f"(the engine's --max-waiting); retry later"
            )
        self.waiting.append(seq)

    def fits_ever(self, tokens: int) -> bool:
        return blocks_for(tokens, self.block_size) <= self.pool.total

    def reap(self, on_done: Callable[[Seq], None]) -> None:
        """End every request whose client left, waiting or running; free its blocks."""
        for seq in [s for s in self.waiting if s.cancel.is_set()]:
            self.waiting.remove(seq)
            self._finish(seq, "cancelled", on_done)
        for seq in [s for s in self.running if s.cancel.is_set()]:
            self._finish(seq, "cancelled", on_done)

    def plan(self) -> Plan | None:
        """Every running request decodes; new prompts join as KV blocks and the prefill
        budget allow, in arrival order."""
        decode = tuple(self.running)
        admitted: list[Seq] = []
        budget = self.prefill_tokens
        while self.waiting and len(self.running) + len(admitted) < self.max_running:
            head = self.waiting[0]
            need = blocks_for(head.kv_tokens, self.block_size)
            if need > self.pool.free or (admitted and len(head.prompt) > budget):
                break
            self.waiting.popleft()
            head.blocks = self.pool.take(need)
            admitted.append(head)
            budget -= len(head.prompt)
        self.running.extend(admitted)
        if not admitted and not decode:
            return None
        return Plan(tuple(admitted), decode)

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

    def drop(self, seq: Seq) -> None:
        """Take a request out of the running batch and give its blocks back."""
        if seq in self.running:
            self.running.remove(seq)
        self.pool.give_back(seq.blocks)
        seq.blocks = []

    def _finish(self, seq: Seq, reason: str, on_done: Callable[[Seq], None]) -> None:
        seq.finish_reason = reason
        self.drop(seq)
        on_done(seq)
