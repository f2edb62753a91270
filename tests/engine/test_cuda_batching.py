"""Continuous batching on a GPU: the Triton decode kernel, CUDA graphs, bf16 tolerance.

bf16 tolerance: a request's logits depend (in the last bits) on the batch it runs in,
because the matrix products of a batch of 8 and of 1 pick different kernels and summation
orders, and bf16 keeps 8 bits of mantissa. Greedy tokens can then differ where two
candidates are within rounding of each other. So in bf16 the test compares the logprob of
each token of the single-stream run, as the batched run scores it, within 0.05 (about six
bf16 ulps at |logprob| ~ 5), over the positions both runs share before their first
differing token; float32 on CUDA must give the same tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.attention import _decode_gather
from engine.job import Job
from tests.engine.test_engine_batching import build_engine, mixed_jobs, staggered

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

BF16_LOGPROB_TOL = 0.05


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 2, 16), (32, 8, 128), (12, 4, 128)])
def test_triton_decode_equals_gather_and_sdpa(dtype: torch.dtype, heads: tuple[int, ...]) -> None:
    from engine.paged_decode import paged_decode

    h, kvh, dim = heads
    blocks, bs = 64, 16
    torch.manual_seed(0)
    k = torch.randn(blocks + 1, bs, kvh, dim, device="cuda", dtype=dtype)
    v = torch.randn(blocks + 1, bs, kvh, dim, device="cuda", dtype=dtype)
    lengths = torch.tensor([1, 16, 17, 100, 333, 5], dtype=torch.int32, device="cuda")
    tables = torch.full((6, 32), blocks, dtype=torch.int32, device="cuda")
    perm, at = torch.randperm(blocks).int().cuda(), 0
    for r, n in enumerate(lengths.tolist()):
        need = -(-n // bs)
        tables[r, :need] = perm[at : at + need]
        at += need
    q = torch.randn(6, h, dim, device="cuda", dtype=dtype)
    got = paged_decode(q, k, v, tables, lengths).float()
    want = _decode_gather(q.float(), k.float(), v.float(), tables, lengths)
    err = (got - want).norm() / want.norm()
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), float(err)


def test_float32_tokens_alone_equal_batched_with_graphs(tiny_model: Path) -> None:
    e = build_engine(tiny_model, device="cuda:0", graphs=True)
    while e.runner.capture_next():
        pass
    assert e.runner.graphs is not None and len(e.runner.graphs.graphs) >= 5
    e.start()
    try:
        jobs = mixed_jobs(12)
        alone = [e.run(job) for job in jobs]
        batched, peak = staggered(e, jobs, after=2)
        assert peak >= 8
        for a, b in zip(alone, batched, strict=True):
            assert a.tokens == b.tokens
    finally:
        e.stop_followers()


def test_graph_replay_equals_eager(tiny_model: Path) -> None:
    jobs = mixed_jobs(10)
    eager = build_engine(tiny_model, device="cuda:0", graphs=False)
    graphed = build_engine(tiny_model, device="cuda:0", graphs=True)
    while graphed.runner.capture_next():
        pass
    out = []
    for e in (eager, graphed):
        e.start()
        try:
            out.append([f.result(120) for f in [e.submit(j) for j in jobs]])
        finally:
            e.stop_followers()
    for a, b in zip(*out, strict=True):
        assert a.tokens == b.tokens
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.steps, b.steps, strict=True)) < 1e-4


def test_bf16_batched_logprobs_within_tolerance(tiny_model: Path) -> None:
    e = build_engine(tiny_model, device="cuda:0", dtype=torch.bfloat16, graphs=True)
    e.start()
    try:
        jobs = mixed_jobs(12)
        alone = [e.run(job) for job in jobs]
        batched, _ = staggered(e, jobs, after=2)
        for job, a, b in zip(jobs, alone, batched, strict=True):
            shared = 0
            while shared < job.max_tokens and a.tokens[shared] == b.tokens[shared]:
                shared += 1
            assert shared >= 1
            for x, y in zip(a.steps[:shared], b.steps[:shared], strict=True):
                assert abs(x.logprob - y.logprob) <= BF16_LOGPROB_TOL
    finally:
        e.stop_followers()


def test_kv_budget_larger_than_free_memory_names_both(tiny_model: Path) -> None:
    from engine.errors import EngineError
    from engine.kvcache import KVCache

    free = torch.cuda.mem_get_info(0)[0] >> 20
    with pytest.raises(EngineError, match=rf"--kv-cache-mb {free * 2} does not fit .* MB free"):
        KVCache(2, 2, 16, free * 2, torch.float32, torch.device("cuda:0"))


def test_a_request_alone_decodes_after_a_long_batch(tiny_model: Path) -> None:
    """Padding rows of a captured graph never touch a real request's cache."""
    e = build_engine(tiny_model, device="cuda:0", graphs=True)
    while e.runner.capture_next():
        pass
    e.start()
    try:
        job = Job((3, 1, 4, 1, 5), 40, ignore_eos=True)
        first = e.run(job)
        [f.result(120) for f in [e.submit(j) for j in mixed_jobs(7)]]
        assert e.run(job).tokens == first.tokens
    finally:
        e.stop_followers()


def test_a_continuation_of_a_kept_past_gives_the_uninterrupted_tokens(tiny_model: Path) -> None:
    """On CUDA a continued prompt's fresh tokens run in the decode part of the step, through
    the Triton kernel (engine/runner.py `_inputs`); float32: the same tokens as the whole
    stream, beside other requests and a captured decode graph's steps."""
    e = build_engine(tiny_model, device="cuda:0", graphs=True)
    e.start()
    try:
        prompt = (5, 17, 99, 3, 250, 42, 7, 11, 130)
        whole = e.run(Job(prompt, 64, ignore_eos=True)).tokens
        e.warm("k", prompt + tuple(whole[:20])).result(timeout=60)
        e.warm("k", prompt + tuple(whole[:40])).result(timeout=60)
        beside = e.submit(Job(prompt, 64, ignore_eos=True))
        cont = e.run(Job(prompt + tuple(whole[:45]), 19, ignore_eos=True, warm_key="k"))
        assert cont.tokens == whole[45:] and beside.result(timeout=60).tokens == whole
        assert e.stats().reused_tokens >= len(prompt) + 40
    finally:
        e.stop_followers()


def test_continuations_replay_a_captured_graph_and_give_the_uninterrupted_tokens(
    tiny_model: Path,
) -> None:
    """With every graph captured, a warm prefill's and a continuation's fresh tokens run as
    rows of a graph's replay (not eagerly), 12 rows for three streams in the 16-row graph;
    float32: each stream's tokens are the same as when it ran whole."""
    e = build_engine(tiny_model, device="cuda:0", graphs=True)
    while e.runner.capture_next():
        pass
    graphs = e.runner.graphs
    assert graphs is not None
    e.start()
    try:
        prompts = [(5, 17, 99, 3, 250, 42, 7, 11, 130), (8, 1, 77, 200, 9), (64, 65, 66)]
        wholes = [e.run(Job(p, 48, ignore_eos=True)).tokens for p in prompts]
        for upto in (4, 10):  # a prefill, then the 6 tokens after what is kept
            before = graphs.continued
            for i, (p, whole) in enumerate(zip(prompts, wholes, strict=True)):
                e.warm(f"s{i}", p + tuple(whole[:upto])).result(timeout=60)
        assert graphs.continued > before
        before = graphs.continued
        conts = [
            e.submit(Job(p + tuple(whole[:14]), 34, ignore_eos=True, warm_key=f"s{i}"))
            for i, (p, whole) in enumerate(zip(prompts, wholes, strict=True))
        ]
        for cont, whole in zip(conts, wholes, strict=True):
            assert cont.result(timeout=60).tokens == whole[14:]
        assert graphs.continued > before
    finally:
        e.stop_followers()


def test_a_steps_tokens_go_out_before_an_eager_step_and_after_a_replays_launch(
    tiny_model: Path,
) -> None:
    """The last step's tokens (`launched`) wait for the next step's launch only when that
    is a graph replay; a step run eagerly (a prompt longer than the largest graph) posts
    them before its first kernel, not after its launches."""
    from engine.scheduler import Seq

    e = build_engine(tiny_model, device="cuda:0", graphs=True)
    while e.runner.capture_next():
        pass
    assert e.runner.graph_rows == 16
    order: list[str] = []
    e.runner.model.register_forward_pre_hook(lambda *_: order.append("forward"))
    s = e.scheduler
    s.add(Seq(tuple(range(1, 41)), 2, ignore_eos=True))
    for want in (["launched", "forward"], ["launched"], []):
        plan = s.plan(e.runner.graph_rows)
        if plan is None:
            assert want == []
            break
        order.clear()
        steps = e.runner.step(plan, launched=lambda: order.append("launched"))
        assert order == want
        s.record(plan, steps, lambda seq: None)
    assert not s.running
