"""Kept prefixes: a standby that kept a stream's past warm continues it computing only the
tokens after that past, with the tokens the uninterrupted stream has; a kept past that does
not begin the continuation is not used; kept blocks give way to requests and come back
when told. In-process on the tiny checkpoint in float32 on CPU (the real engine loop); the
HTTP endpoint on a real engine process."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import batcher as engine_batcher
from engine import scheduler as scheduler_module
from engine.batcher import BatchEngine
from engine.job import Job, Step
from engine.kvcache import BlockAllocator, blocks_for
from engine.launch import EngineProcess
from engine.scheduler import Scheduler, Seq
from tests.engine.test_engine_batching import build_engine

PROMPT = (5, 17, 99, 3, 250, 42, 7, 11, 130)


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> BatchEngine:
    e = build_engine(tiny_model)
    e.start()
    yield e
    e.stop_followers()


@pytest.fixture(scope="module")
def whole(engine: BatchEngine) -> list[int]:
    """The uninterrupted answer: 48 greedy tokens."""
    return engine.run(Job(PROMPT, 48, ignore_eos=True)).tokens


def test_a_continuation_of_a_kept_past_computes_only_what_came_after(
    engine: BatchEngine, whole: list[int]
) -> None:
    past = PROMPT + tuple(whole[:20])
    engine.warm("s1", past).result(timeout=60)
    assert engine.scheduler.kept["s1"].tokens == past
    before = engine.stats().reused_tokens
    cont = Job(PROMPT + tuple(whole[:27]), 21, ignore_eos=True, warm_key="s1")
    assert engine.run(cont).tokens == whole[27:]
    assert engine.stats().reused_tokens - before == len(past)  # 7 fresh tokens computed
    assert "s1" not in engine.scheduler.kept  # taken over, given back when it ended
    assert engine.stats().kv_blocks_used == 0


def test_a_past_kept_in_steps_extends_what_it_kept(engine: BatchEngine, whole: list[int]) -> None:
    engine.warm("s2", PROMPT + tuple(whole[:8])).result(timeout=60)
    before = engine.stats().reused_tokens
    engine.warm("s2", PROMPT + tuple(whole[:30])).result(timeout=60)
    assert engine.stats().reused_tokens - before == len(PROMPT) + 8
    cont = Job(PROMPT + tuple(whole[:30]), 18, ignore_eos=True, warm_key="s2")
    # all of the continuation's prompt was kept, and the token the warm prefill sampled
    # after it: that is its first, and it computes nothing of its prompt
    before, steps = engine.stats().reused_tokens, engine.stats().steps
    got: list[Step] = []
    assert engine.run(cont, got.append).tokens == whole[30:]
    assert engine.stats().reused_tokens - before == len(PROMPT) + 30
    assert got[0].kept == len(PROMPT) + 30
    assert engine.stats().steps - steps == 17  # the 17 tokens after the first


def test_a_continuation_shorter_than_the_past_kept_computes_its_last_token(
    engine: BatchEngine, whole: list[int]
) -> None:
    """The client had fewer tokens than the kept past holds (the last ones never reached
    it): the token sampled after the past is not its first; it computes its last token
    again to sample the one after it."""
    engine.warm("s2b", PROMPT + tuple(whole[:30])).result(timeout=60)
    cont = Job(PROMPT + tuple(whole[:26]), 10, ignore_eos=True, warm_key="s2b")
    before = engine.stats().reused_tokens
    got: list[Step] = []
    assert engine.run(cont, got.append).tokens == whole[26:36]
    assert engine.stats().reused_tokens - before == len(PROMPT) + 25 == got[0].kept


def test_a_kept_past_that_does_not_begin_the_prompt_is_not_used(
    engine: BatchEngine, whole: list[int]
) -> None:
    engine.warm("s3", PROMPT + (1, 2, 3)).result(timeout=60)
    before = engine.stats().reused_tokens
    cont = Job(PROMPT + tuple(whole[:12]), 36, ignore_eos=True, warm_key="s3")
    assert engine.run(cont).tokens == whole[12:]
    assert engine.stats().reused_tokens == before
    assert "s3" not in engine.scheduler.kept and engine.stats().kv_blocks_used == 0


def test_continuations_beside_fresh_prompts_and_decodes_get_their_own_tokens(
    engine: BatchEngine, whole: list[int]
) -> None:
    """Several continuations of kept pasts, fresh prompts and running decodes in the steps
    of one burst (continuations first, then the prompts beside their decodes): each
    request gets the tokens it has alone."""
    other = (9, 8, 7, 6, 5, 4, 3, 2, 1, 200, 201)
    other_whole = engine.run(Job(other, 40, ignore_eos=True)).tokens
    engine.warm("a", PROMPT + tuple(whole[:16])).result(timeout=60)
    engine.warm("b", other + tuple(other_whole[:5])).result(timeout=60)
    futures = [
        engine.submit(Job(PROMPT, 48, ignore_eos=True)),
        engine.submit(Job(PROMPT + tuple(whole[:19]), 29, ignore_eos=True, warm_key="a")),
        engine.submit(Job(other + tuple(other_whole[:9]), 31, ignore_eos=True, warm_key="b")),
        engine.submit(Job(other, 40, ignore_eos=True)),
    ]
    got = [f.result(timeout=120).tokens for f in futures]
    assert got == [whole, whole[19:], other_whole[9:], other_whole]
    assert not engine.scheduler.kept


class Waits(threading.Event):
    """The loop's wake-up event, telling the test each time the loop goes to wait on it."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.entered.set()
        return super().wait(timeout)


def test_continuations_arriving_apart_prefill_in_one_step(
    engine: BatchEngine, whole: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A promoted engine gets its cut streams' continuations one after another: while they
    still arrive the loop waits, so the first does not step alone. Each continuation is
    submitted once the loop has gone back to waiting after the one before (the windows
    widened so that this is inside them on any machine)."""
    keys = ("g1", "g2", "g3")
    for n, key in enumerate(keys):
        engine.warm(key, PROMPT + tuple(whole[: 10 + n])).result(timeout=60)
    monkeypatch.setattr(engine_batcher, "GATHER_QUIET_S", 30.0)
    monkeypatch.setattr(engine_batcher, "GATHER_MAX_S", 60.0)
    steps = engine.stats().steps
    old, engine._wake = engine._wake, Waits()
    old.set()  # the loop, idle on the old event, waits on the new one from now on
    futures = []
    try:
        for n, key in enumerate(keys):
            assert engine._wake.entered.wait(timeout=60)
            engine._wake.entered.clear()
            job = Job(PROMPT + tuple(whole[: 12 + n]), 6, ignore_eos=True, warm_key=key)
            futures.append(engine.submit(job))
        assert engine._wake.entered.wait(timeout=60)  # the last one is gathered too
        monkeypatch.setattr(engine_batcher, "GATHER_QUIET_S", 0.0)
        engine._wake.set()
        got = [f.result(timeout=60).tokens for f in futures]
    finally:
        waits, engine._wake = engine._wake, old
        waits.set()
    assert got == [whole[12 + n : 18 + n] for n in range(3)]
    assert engine.stats().steps - steps == 6  # one prefill step for all three, 5 decodes
    assert not engine.scheduler.kept


def test_warm_prefills_arriving_apart_run_in_one_step_and_hold_back_no_request(
    engine: BatchEngine, whole: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A standby gets the pasts of many streams at once, one request each: while they still
    arrive and are all it has to run, it waits, and they prefill in one step. A request
    arriving meanwhile is not held: the warm prefills waiting run in its first step. Each
    is submitted once the loop has gone back to waiting (the windows widened so that this
    is inside them on any machine)."""
    monkeypatch.setattr(engine_batcher, "GATHER_QUIET_S", 30.0)
    monkeypatch.setattr(engine_batcher, "GATHER_MAX_S", 60.0)
    pasts = {f"w{n}": PROMPT + tuple(whole[: 10 + n]) for n in range(4)}
    steps = engine.stats().steps
    old, engine._wake = engine._wake, Waits()
    old.set()  # the loop, idle on the old event, waits on the new one from now on
    try:
        futures = []
        for key in ("w0", "w1", "w2"):
            assert engine._wake.entered.wait(timeout=60)
            engine._wake.entered.clear()
            futures.append(engine.warm(key, pasts[key]))
        assert engine._wake.entered.wait(timeout=60)  # gathering all three
        assert engine.stats().steps == steps
        monkeypatch.setattr(engine_batcher, "GATHER_QUIET_S", 0.0)
        engine._wake.set()
        for f in futures:
            f.result(timeout=60)
        assert engine.stats().steps - steps == 1
        monkeypatch.setattr(engine_batcher, "GATHER_QUIET_S", 30.0)
        steps = engine.stats().steps
        engine._wake.entered.clear()
        held = engine.warm("w3", pasts["w3"])
        assert engine._wake.entered.wait(timeout=60)
        got = engine.run(Job(PROMPT, 4, ignore_eos=True)).tokens
        held.result(timeout=60)
    finally:
        waits, engine._wake = engine._wake, old
        waits.set()
    assert got == whole[:4]
    assert engine.stats().steps - steps == 4  # the request's prefill (with w3's), 3 decodes
    assert {k: engine.scheduler.kept[k].tokens for k in pasts} == pasts
    for key in pasts:
        assert engine.forget(key)
    assert engine.stats().kv_blocks_used == 0


def test_kept_blocks_give_way_to_requests_and_come_back_when_forgotten(
    tiny_model: Path,
) -> None:
    e = build_engine(tiny_model, blocks=12)
    e.start()
    try:
        bs = e.scheduler.block_size
        past = tuple(range(1, 3 * bs + 1))  # 3 blocks each
        for key in ("old", "mid", "new"):
            e.warm(key, past).result(timeout=60)
        assert e.stats().kv_blocks_kept == 9 and e.stats().kv_blocks_free == 3
        assert e.forget("mid") and not e.forget("mid")
        assert e.stats().kv_blocks_kept == 6
        # a request of 8 blocks: the least recently kept past gives way, the other stays
        job = Job(tuple(range(5, 5 + 4 * bs)), 4 * bs, ignore_eos=True)
        assert blocks_for(len(job.prompt) + job.max_tokens - 1, bs) == 8
        assert len(e.run(job).steps) == job.max_tokens
        assert list(e.scheduler.kept) == ["new"]
        assert e.forget("new") and e.stats().kv_blocks_used == 0
    finally:
        e.stop_followers()


def _post(url: str, body: dict[str, object]) -> tuple[int, dict[str, object]]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_standby_keeps_a_past_over_http_and_refuses_bad_input(standby_engine: str) -> None:
    url = standby_engine + "/holdfast/warm"
    status, body = _post(url, {"key": "k", "prompt": list(PROMPT)})
    assert status == 200 and body["kept"] == len(PROMPT)
    status, body = _post(url, {"key": "", "prompt": list(PROMPT)})
    assert status == 400 and "key" in body["error"]["message"]
    status, body = _post(url, {"key": "k", "prompt": [10**9]})
    assert status == 400 and "vocabulary" in body["error"]["message"]
    status, body = _post(url, {"prompt": [1]})
    assert status == 400 and "key" in body["error"]["message"]
    assert _post(url, {"key": "k", "forget": True}) == (200, {"key": "k", "forgotten": True})
    assert _post(url, {"key": "k", "forget": True}) == (200, {"key": "k", "forgotten": False})


@pytest.fixture(scope="module")
def standby_engine(tiny_model: Path) -> Iterator[str]:
    """A real engine process, a standby: it serves nothing, but keeps pasts warm."""
    p = EngineProcess(
        ["--model", str(tiny_model), "--dtype", "float32", "--allow-disk-fallback"]
        + ["--role", "standby", "--name", "warm"]
    )
    try:
        p.wait_ready()
        yield p.url
    finally:
        p.stop()


def fresh_scheduler() -> Scheduler:
    """A scheduler of 64 blocks with room for a whole prompt in one step."""
    return Scheduler(
        BlockAllocator(64),
        frozenset(),
        block_size=16,
        max_running=8,
        max_waiting=8,
        prefill_tokens=1024,
    )


def test_a_continuation_cancels_the_wait_of_a_warm_request_for_its_own_past() -> None:
    """Once promoted, a standby gets continuations behind warm requests still queued for
    the same streams: those would only delay them, so they are cancelled; others stay."""
    s = fresh_scheduler()
    mine = Seq(PROMPT, 1, warm_key="k", warming=True)
    other = Seq(PROMPT, 1, warm_key="j", warming=True)
    s.add(mine)
    s.add(other)
    s.add(Seq(PROMPT + (1, 2), 5, warm_key="k"))
    assert mine.cancel.is_set() and not other.cancel.is_set()


def test_continuations_step_first_and_apart_from_whole_prompts() -> None:
    """A continuation queued behind a request's prompt and a warm past runs first, in a
    step of its own (a few fresh tokens, not a long prefill); the prompts join the next
    step, beside its decode."""
    s = fresh_scheduler()
    first, warm = Seq(PROMPT, 4), Seq(PROMPT + (7,), 1, warm_key="j", warming=True)
    cont = Seq(PROMPT + (1, 2), 5, warm_key="k")
    for seq in (first, warm, cont):
        s.add(seq)
    plan = s.plan()
    assert plan is not None and plan.prefill == (cont,) and plan.decode == ()
    plan = s.plan()
    assert plan is not None and plan.prefill == (first, warm) and plan.decode == (cont,)


def test_warm_prefills_fill_a_step_only_up_to_the_rows_of_a_graph() -> None:
    """A standby's step of warm pasts stops at the rows it is given (the largest captured
    graph's): the rest wait for the next step, in arrival order. A past longer than that
    still runs, alone; continuations are bounded the same way; with no bound the prefill
    budget alone decides."""

    def warm(n: int, key: str) -> Seq:
        return Seq(tuple(range(1, n + 1)), 1, warm_key=key, warming=True)

    s = fresh_scheduler()
    first, second, third, long = warm(20, "a"), warm(20, "b"), warm(5, "c"), warm(50, "d")
    for seq in (first, second, third, long):
        s.add(seq)
    steps = []
    while (plan := s.plan(graph_rows=40)) is not None:
        steps.append(plan.prefill)
        s.record(plan, [Step(0, 0.0, ())] * len(plan.seqs), lambda seq: None)
    assert steps == [(first, second), (third,), (long,)]
    # continuations of three kept pasts, 15 fresh tokens each: two fit 40 rows, the third
    # goes in the next step, beside their decodes
    conts = [Seq(seq.prompt + tuple(range(15)), 4, warm_key=seq.warm_key) for seq in steps[0]]
    conts.append(Seq(third.prompt + tuple(range(15)), 4, warm_key="c"))
    for seq in conts:
        s.add(seq)
    plan = s.plan(graph_rows=40)
    assert plan is not None and plan.prefill == tuple(conts[:2]) and not plan.decode
    assert sum(seq.fresh for seq in plan.prefill) == 30
    s.record(plan, [Step(0, 0.0, ())] * len(plan.seqs), lambda seq: None)
    plan = s.plan(graph_rows=40)
    assert plan is not None and plan.prefill == (conts[2],) and plan.decode == tuple(conts[:2])
    s = fresh_scheduler()
    for seq in (warm(20, "a"), warm(20, "b"), warm(5, "c"), warm(50, "d")):
        s.add(seq)
    plan = s.plan()
    assert plan is not None and len(plan.prefill) == 4


def test_whole_warm_pasts_longer_than_a_graph_share_eager_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A heir given every stream's whole past at once (newly named, or refitted to new
    weights) runs them in as few eager steps as EAGER_WARM_ROWS allows, not one step each:
    a step whose first warm past is longer than a graph holds takes more warm pasts up to
    that many tokens. A continuation gains no room from it."""
    monkeypatch.setattr(scheduler_module, "EAGER_WARM_ROWS", 100)

    def warm(n: int, key: str) -> Seq:
        return Seq(tuple(range(1, n + 1)), 1, warm_key=key, warming=True)

    s = fresh_scheduler()
    pasts = [warm(45, k) for k in "abcde"]
    for seq in pasts:
        s.add(seq)
    steps = []
    while (plan := s.plan(graph_rows=40)) is not None:
        steps.append(plan.prefill)
        s.record(plan, [Step(0, 0.0, ())] * len(plan.seqs), lambda seq: None)
    assert steps == [tuple(pasts[:2]), tuple(pasts[2:4]), (pasts[4],)]
    # continuations of 45 fresh tokens each: one a step, as before
    conts = [Seq(seq.prompt + tuple(range(45)), 4, warm_key=seq.warm_key) for seq in pasts[:2]]
    for seq in conts:
        s.add(seq)
    plan = s.plan(graph_rows=40)
    assert plan is not None and plan.prefill == (conts[0],)


def test_a_continuation_is_told_what_its_kept_past_spared_and_a_warm_it_replaced_fails(
    tiny_model: Path, whole: list[int]
) -> None:
    """The engine's own HTTP server, in-process over the engine loop: a continuation
    answers with KEPT_HEADER once its first step ran, the past kept under its key less
    the prompt's last token. A warm prefill still queued when its continuation comes
    gives way to it (the continuation then keeps nothing) and answers 503, not a 200
    that would say its past is kept."""
    from aiohttp import ClientSession, web

    from engine.api import Limits
    from engine.metrics import Metrics
    from engine.server import EngineServer
    from engine.tokenizer import load_tokenizer
    from holdfast_contract.control import KEPT_HEADER

    e = build_engine(tiny_model)
    e.start()
    past = [*PROMPT, *whole[:20]]
    cont = {"prompt": [*past, *whole[20:23]], "max_tokens": 4, "ignore_eos": True}
    cont |= {"stream": True, "return_token_ids": True}

    async def continued(http: ClientSession, url: str, key: str) -> tuple[str, list[int]]:
        async with http.post(url + "/v1/completions", json=cont | {"holdfast_warm": key}) as r:
            assert r.status == 200, await r.text()
            ids = []
            for line in (await r.text()).splitlines():
                if line.startswith("data: {"):
                    ids += json.loads(line[6:])["choices"][0].get("token_ids") or []
            return r.headers.get(KEPT_HEADER, ""), ids

    async def until_waiting(n: int) -> None:
        for _ in range(6000):  # a deadline far above any machine's pace, polled
            if e.stats().waiting == n:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"the engine never had {n} requests waiting")

    async def main() -> None:
        limits = Limits(vocab_size=512, max_model_len=512, max_tokens_cap=64)
        server = EngineServer("e", "primary", 1, e, load_tokenizer(tiny_model), limits, Metrics())
        server.bind(asyncio.get_running_loop())
        server.ready()
        runner = web.AppRunner(server.app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        try:
            async with ClientSession() as http:
                async with http.post(
                    url + "/holdfast/warm", json={"key": "a", "prompt": past}
                ) as r:
                    assert r.status == 200
                assert await continued(http, url, "a") == (str(len(past)), whole[23:27])

                gate = threading.Event()  # the model thread waits: the next warm is queued
                busy = e.between_steps(lambda: gate.wait(60), forget=False)
                warm = asyncio.ensure_future(
                    http.post(url + "/holdfast/warm", json={"key": "b", "prompt": past})
                )
                await until_waiting(1)
                going = asyncio.ensure_future(continued(http, url, "b"))
                await until_waiting(2)
                gate.set()
                busy.result(timeout=60)
                assert await going == ("0", whole[23:27])  # it computed its whole past
                r = await warm
                assert r.status == 503 and "cancelled" in (await r.json())["error"]["message"]
                r.release()
        finally:
            await runner.cleanup()

    try:
        asyncio.run(main())
    finally:
        e.stop_followers()
