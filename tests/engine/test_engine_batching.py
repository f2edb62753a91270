"""Continuous batching: the same tokens alone or in a batch, a full KV cache that queues and
sheds instead of corrupting, and slots freed at once when a request ends or its client leaves.

In-process tests drive the real engine loop (its own thread) on the tiny checkpoint in
float32 on CPU; the HTTP tests run real engine processes.
"""

from __future__ import annotations

import concurrent.futures
import threading
from pathlib import Path

import pytest
import torch

from cachedaemon.client import assign
from cachedaemon.loader import LoadOptions, load_state_dict
from engine.batcher import BatchEngine
from engine.errors import BadRequest, QueueFull
from engine.job import Generation, Job, Step
from engine.kvcache import BlockAllocator, KVCache, blocks_for
from engine.model import LlamaForCausalLM, TPGroup
from engine.modelargs import read_model_args
from engine.runner import Runner
from engine.scheduler import Plan, Scheduler, Seq


def build_engine(
    model_dir: Path,
    *,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    kv_mb: int = 4,
    blocks: int | None = None,
    max_batch: int = 16,
    max_waiting: int = 64,
    graphs: bool = False,
) -> BatchEngine:
    """The engine loop over the checkpoint, not started. `blocks` caps the KV blocks used."""
    args = read_model_args(model_dir)
    model = LlamaForCausalLM(args, TPGroup(), dtype, device=device)
    dt = str(dtype).removeprefix("torch.")
    assign(
        model, load_state_dict(model_dir, LoadOptions(dtype=dt, quantization="none", device=device))
    )
    cache = KVCache(
        args.num_hidden_layers, args.num_key_value_heads, args.head_dim, kv_mb, dtype, device
    )
    runner = Runner(
        model, torch.device(device), cache, max_batch=max_batch, max_len=512, cuda_graphs=graphs
    )
    runner.warmup()
    scheduler = Scheduler(
        BlockAllocator(blocks if blocks is not None else cache.blocks),
        runner.eos,
        block_size=cache.block_size,
        max_running=max_batch,
        max_waiting=max_waiting,
        prefill_tokens=8192,
    )
    return BatchEngine(runner, scheduler)


def mixed_jobs(n: int) -> list[Job]:
    """Prompts of 1..40 tokens, 3..60 output tokens, every one different."""
    jobs = []
    for i in range(n):
        prompt = tuple((7 * i + 3 * j + 1) % 250 for j in range(1 + (i * 13) % 40))
        jobs.append(Job(prompt, 3 + (i * 17) % 58, top_logprobs=2, ignore_eos=True))
    return jobs


def staggered(engine: BatchEngine, jobs: list[Job], after: int) -> tuple[list[Generation], int]:
    """Submit job i+1 once job i has `after` tokens, so requests join at different steps;
    (their generations, the largest running batch seen)."""
    futures: list[concurrent.futures.Future[Generation]] = []
    peak = [0]

    def submit(i: int) -> None:
        seen = [0]

        def on_step(_: Step) -> None:
            seen[0] += 1
            peak[0] = max(peak[0], engine.stats().running)
            if seen[0] == after and i + 1 < len(jobs):
                submit(i + 1)

        futures.append(engine.submit(jobs[i], on_step))

    submit(0)
    gens = []
    while len(gens) < len(jobs):  # futures grows as earlier requests submit later ones
        gens.append(futures[len(gens)].result(timeout=120))
    return gens, peak[0]


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> BatchEngine:
    e = build_engine(tiny_model)
    e.start()
    yield e
    e.stop_followers()


def test_greedy_tokens_are_the_same_alone_and_in_a_batch(engine: BatchEngine) -> None:
    jobs = mixed_jobs(12)
    alone = [engine.run(job) for job in jobs]
    batched, peak = staggered(engine, jobs, after=2)
    assert peak >= 8, f"at most {peak} requests ever ran together: nothing was batched"
    for job, a, b in zip(jobs, alone, batched, strict=True):
        assert len(b.steps) == job.max_tokens
        assert b.tokens == a.tokens  # exact, float32 on CPU
        for x, y in zip(a.steps, b.steps, strict=True):
            assert abs(x.logprob - y.logprob) < 1e-4
            assert [t for t, _ in x.top] == [t for t, _ in y.top]


def test_alone_equals_recomputing_the_whole_prefix(engine: BatchEngine) -> None:
    """Decoding from the paged cache gives what a fresh prefill of the prefix gives."""
    job = Job((5, 17, 99, 3, 250, 42, 7), 20, ignore_eos=True)
    tokens = engine.run(job).tokens
    for n in (1, 7, 19):
        prefix = Job(job.prompt + tuple(tokens[:n]), 1, ignore_eos=True)
        assert engine.run(prefix).tokens == [tokens[n]]


def test_on_the_cpu_the_last_steps_tokens_go_out_before_the_next_step(tiny_model: Path) -> None:
    """A CPU step computes as it is called, so `launched` (which posts the last step's
    tokens) runs before it: a token never waits for the next step, a long prefill included."""
    runner = build_engine(tiny_model).runner
    seq = Seq(tuple(range(1, 41)), 4, ignore_eos=True)
    seq.blocks = [1, 2, 3]
    runner.cache.k[:, 1:4].zero_()
    written: list[bool] = []
    runner.step(
        Plan(prefill=(seq,)), launched=lambda: written.append(bool(runner.cache.k[:, 1:4].any()))
    )
    assert written == [False], "launched ran after the step had written its keys"
    assert runner.cache.k[:, 1:4].any(), "the step wrote no keys: the check above means nothing"


def test_a_full_cache_queues_then_sheds_and_never_corrupts(tiny_model: Path) -> None:
    # 4 KV blocks of 16 tokens: 2 requests of 32 positions run at once, 2 more may wait
    e = build_engine(tiny_model, blocks=4, max_waiting=2)
    jobs = [Job((1 + i, 2, 3), 30, ignore_eos=True) for i in range(16)]  # 4x capacity
    want = {}
    accepted, shed = {}, 0
    for i, job in enumerate(jobs):  # the loop is not running yet: nothing frees a slot
        try:
            accepted[i] = e.submit(job)
        except QueueFull as err:
            assert "--max-waiting" in str(err)
            shed += 1
    assert (len(accepted), shed) == (2, 14)  # only the waiting bound: nothing is admitted yet
    e.start()
    try:
        more = {i: e.submit(jobs[i]) for i in (2, 3)}  # join while the first ones run
        for i, fut in {**accepted, **more}.items():
            gen = fut.result(timeout=120)
            assert gen.finish_reason == "length" and len(gen.steps) == 30
            want[i] = gen.tokens
        for i in want:  # every accepted request has the tokens it would have alone
            assert e.run(jobs[i]).tokens == want[i]
        assert e.stats().kv_blocks_used == 0
    finally:
        e.stop_followers()


def test_a_request_larger_than_the_whole_cache_is_refused(tiny_model: Path) -> None:
    e = build_engine(tiny_model, blocks=2)
    with pytest.raises(BadRequest, match="KV cache"):
        e.submit(Job(tuple(range(1, 20)), 20))  # 38 positions > 2 blocks of 16


def test_a_cancelled_request_leaves_the_batch_at_the_next_step(engine: BatchEngine) -> None:
    cancel = threading.Event()
    seen: list[int] = []
    running_after: list[int] = []

    def on_step(step: Step) -> None:
        seen.append(step.token)
        if len(seen) == 3:
            cancel.set()
        elif len(seen) > 3:
            running_after.append(len(seen))

    gen = engine.submit(Job((1, 2, 3), 400, ignore_eos=True), on_step, cancel).result(60)
    assert gen.finish_reason == "cancelled"
    assert len(gen.steps) <= 4  # at most the step already under way when it was cancelled
    assert engine.stats().running == 0 and engine.stats().kv_blocks_used == 0


def test_eos_ends_a_request_and_frees_its_blocks(engine: BatchEngine) -> None:
    probe = engine.run(Job((9, 8, 7), 1, ignore_eos=True))
    eos = probe.tokens[0]
    engine.scheduler.eos = frozenset({eos})  # the first token sampled is now "EOS"
    try:
        gen = engine.run(Job((9, 8, 7), 50))
    finally:
        engine.scheduler.eos = engine.runner.eos
    assert (gen.finish_reason, gen.tokens) == ("stop", [eos])
    assert engine.stats().kv_blocks_used == 0


def test_scheduler_admits_first_come_first_served() -> None:
    allocator = BlockAllocator(6)
    s = Scheduler(
        allocator, frozenset(), block_size=16, max_running=8, max_waiting=8, prefill_tokens=100
    )
    big, small = Seq(tuple(range(60)), 30), Seq((1,), 2)  # 89 positions: 6 blocks; then 1
    s.add(big)
    s.add(small)
    running = Seq((1,), 20)
    running.blocks = allocator.take(1)  # one block held: big no longer fits
    s.running.append(running)
    plan = s.plan()
    assert plan is not None and plan.prefill == ()  # small may not jump ahead of big
    assert plan.decode == (running,)
    assert list(s.waiting) == [big, small]
    s.drop(running)
    plan = s.plan()
    assert plan is not None and (plan.prefill, plan.decode) == ((big,), ())
    assert blocks_for(big.kv_tokens) == 6 and allocator.free == 0
    running.out.append(Step(5, -1.0))
    s.running.append(running)  # a new prompt is prefilled in the step that decodes the rest
    s.drop(big)
    s.add(Seq((1, 2), 3))
    plan = s.plan()
    assert plan is not None and len(plan.prefill) == 2 and plan.decode == (running,)


def test_garbage_in_unwritten_cache_memory_never_reaches_a_request(tiny_model: Path) -> None:
    """The cache is allocated, not cleared: positions a request has not written (or blocks
    of other requests padding its table) may hold NaN. They must not leak into it."""
    clean = build_engine(tiny_model)
    poisoned = build_engine(tiny_model)
    poisoned.runner.cache.k.fill_(float("nan"))
    poisoned.runner.cache.v.fill_(float("nan"))
    jobs = mixed_jobs(6)
    for e in (clean, poisoned):
        e.start()
    try:
        want = [clean.run(job).tokens for job in jobs]
        got = [f.result(120).tokens for f in [poisoned.submit(job) for job in jobs]]
    finally:
        clean.stop_followers()
        poisoned.stop_followers()
    assert got == want
