"""An adopted stream's last token prefilled ahead of its continuation (engine/batcher.py
`_ahead`): engine A serves a stream on a shared KV cache and stops; engine B takes that
cache over (a second mapping of the memfd, as a promoted engine's), and as it does,
prefills the stream's last sampled token (the ledger's `sampled`). A continuation with
every token the stream had computes nothing: its first token is the one that prefill
sampled, out before any step of its own; one whose client lacked the last token computes
nothing either: its first is that token, as the ledger names it. Each continuation's
tokens are those of the same request run without a stop. In-process
on the tiny checkpoint in float32 on CPU (the real engine loops)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from engine.batcher import BatchEngine
from engine.job import Job, Step
from engine.kvcache import BLOCK_SIZE, BlockAllocator, KVCache, blocks_in
from engine.kvshare import Adopted, Entry, Layout, SharedKV
from engine.modelargs import read_model_args
from engine.scheduler import LEDGER_STEPS
from tests.engine.test_engine_batching import build_engine

PROMPT = tuple(range(3, 19))
KV_MB = 4
CUT = 21  # tokens A made before it stopped


def dims(model: Path) -> tuple[int, int, int]:
    args = read_model_args(model)
    return args.num_hidden_layers, args.num_key_value_heads, args.head_dim


def on_shared(model: Path, shared: SharedKV) -> BatchEngine:
    """An engine of the checkpoint whose KV cache is `shared`'s tensors."""
    e = build_engine(model, kv_mb=KV_MB)
    cache = KVCache(*dims(model), KV_MB, torch.float32, "cpu", tensors=shared.tensors())
    e.runner.cache = cache
    e.scheduler.allocator = BlockAllocator(cache.usable)
    return e


@pytest.fixture(scope="module")
def left(tiny_model: Path) -> tuple[SharedKV, Entry, list[int]]:
    """A's cache and ledger entry once its stream had CUT tokens, and the stream's whole
    answer run without a stop (64 tokens)."""
    n = dims(tiny_model)
    blocks = blocks_in(KV_MB, *n, torch.float32, BLOCK_SIZE)
    shared = SharedKV.create(Layout(n[0], blocks, BLOCK_SIZE, n[1], n[2], "float32", "m"), 16, 512)
    a = on_shared(tiny_model, shared)
    a.shared = shared
    a.start()
    got: list[Step] = []
    cancel = threading.Event()
    stopped = threading.Event()

    def step(s: Step) -> None:
        got.append(s)
        if len(got) == CUT:  # the model thread stops before its next step
            cancel.set()
            stopped.set()

    fut = a.submit(Job(PROMPT, 64, ignore_eos=True, kv_key="s1"), step, cancel)
    assert stopped.wait(120)
    fut.result(timeout=120)
    entries = shared.read().entries
    whole = a.run(Job(PROMPT, 64, ignore_eos=True)).tokens
    a.stop_followers()
    assert [e.key for e in entries] == ["s1"]
    return shared, entries[0], whole


def adopter(tiny_model: Path, shared: SharedKV, entry: Entry, waiting: int = 64) -> BatchEngine:
    b = build_engine(tiny_model, kv_mb=1, max_waiting=waiting)  # a standby's small cache
    mine = SharedKV(*(os.dup(fd) for fd in shared.fds))
    took = Adopted(mine, [entry], [], (0, None))
    cache = KVCache(*dims(tiny_model), KV_MB, torch.float32, "cpu", tensors=mine.tensors())
    b.take_cache(cache, took).result(timeout=60)
    return b


def test_the_ledger_names_the_last_sampled_token(
    left: tuple[SharedKV, Entry, list[int]],
) -> None:
    _, entry, whole = left
    # the ledger of A's last step: every position but the last sampled token's is written
    past = list(PROMPT) + whole[: len(entry.tokens) - len(PROMPT)]
    # and the steps of its last LEDGER_STEPS tokens sampled: the last one's comes after
    assert entry.tokens == past
    assert [s.token for s in entry.recent] == whole[len(past) - len(PROMPT) - LEDGER_STEPS + 1 :][
        :LEDGER_STEPS
    ]


def test_a_continuation_with_every_token_computes_nothing(
    tiny_model: Path, left: tuple[SharedKV, Entry, list[int]]
) -> None:
    shared, entry, whole = left
    b = adopter(tiny_model, shared, entry)
    b.start()
    try:
        prompt = (*entry.tokens, entry.recent[-1].token)
        sent = len(prompt) - len(PROMPT)
        got: list[Step] = []
        job = Job(prompt, 10, top_logprobs=2, ignore_eos=True, warm_key="s1", kv_key="s1")
        assert b.run(job, got.append).tokens == whole[sent : sent + 10]
        assert got[0].kept == len(prompt)  # all of it: nothing of its prompt computed
        assert len(got[0].top) == 2  # of the 5 kept, what it asked for
        # B's steps: one for the last token (ahead), nine for the tokens after the first
        assert b.stats().steps == 1 + 9
    finally:
        b.stop_followers()


@pytest.mark.parametrize(("lacks", "top"), [(1, 0), (3, 0), (1, 3)])
def test_a_continuation_that_lacks_the_last_tokens_gets_them_from_the_ledger(
    tiny_model: Path, left: tuple[SharedKV, Entry, list[int]], lacks: int, top: int
) -> None:
    """Its client never got the last `lacks` tokens sampled (made, not yet sent): the
    first of them is its first, as the ledger names it (the steps of the last
    LEDGER_STEPS tokens), with nothing computed; unless it asks for more alternatives
    than the stream's request did (none here): then it computes its last token again."""
    shared, entry, whole = left
    assert len(entry.recent) == LEDGER_STEPS
    b = adopter(tiny_model, shared, entry)
    b.start()
    try:
        prompt = (*entry.tokens, entry.recent[-1].token)[: -lacks or None]
        sent = len(prompt) - len(PROMPT)
        got: list[Step] = []
        job = Job(prompt, 10, top_logprobs=top, ignore_eos=True, warm_key="s1", kv_key="s1")
        assert b.run(job, got.append).tokens == whole[sent : sent + 10]
        assert len(got[0].top) == top
        assert got[0].kept == (len(prompt) if top == 0 else len(prompt) - 1)
    finally:
        b.stop_followers()


def test_a_full_queue_leaves_the_last_tokens_to_the_continuations(
    tiny_model: Path, left: tuple[SharedKV, Entry, list[int]]
) -> None:
    """No room in the waiting queue (`--max-waiting`) for the last tokens' prefills: the
    cache is still taken over, and the stream's past kept for its continuation."""
    shared, entry, _ = left
    b = adopter(tiny_model, shared, entry, waiting=0)
    try:
        assert not b.scheduler.waiting
        assert b.scheduler.kept["s1"].tokens == tuple(entry.tokens)
    finally:
        b.stop_followers()
