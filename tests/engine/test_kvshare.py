"""A KV cache shared through the keeper (engine/kvshare.py): another process adopts it,
keys, values and ledger as its writer left them, only once that writer is gone; a writer
stopped (SIGSTOP), not dead, keeps its cache from anyone else.

Real processes, a real keeper on a unix socket, memfds passed between them."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from cachedaemon import protocol
from cachedaemon.keeper import Keeper
from engine.errors import EngineError
from engine.kvahead import Ahead
from engine.kvcache import BlockAllocator
from engine.kvshare import (
    Entry,
    Home,
    Layout,
    NotAdopted,
    SharedKV,
    Slot,
    adopt,
    check,
    wait_exited,
)
from holdfast_contract.agent_protocol import kv_key
from holdfast_contract.ready import start_time

ROOT = Path(__file__).resolve().parents[2]
PYTHONPATH = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
LAYOUT = Layout(
    layers=2, blocks=12, block_size=16, kv_heads=2, head_dim=8, dtype="float32", model="m"
)

# the writer: a cache of LAYOUT deposited under kv/writer, its keys set to 1.5 and values
# to -2, two ledger writes (the second is the one that counts), then it waits
WRITER = textwrap.dedent(
    """
    import sys, time
    from engine.kvshare import Entry, Home, Layout
    layout = Layout(2, 12, 16, 2, 8, "float32", "m")
    home = Home(sys.argv[1], "writer", layout, 1, 4, 64)
    shared = home.fresh(primary=True)
    k, v = shared.tensors()
    k.fill_(1.5)
    v.fill_(-2.0)
    shared.write([Entry("a", [1, 2, 3], [0])], [0])
    shared.write([Entry("a", [1, 2, 3, 4], [0]), Entry("b", list(range(20)), [5, 7])], [0, 5, 7, 9])
    print("written", flush=True)
    time.sleep(600)
    """
)


@pytest.fixture
def keeper(tmp_path: Path):
    with Keeper(tmp_path / "keeper.sock") as k:
        yield k


def spawn(script: str, keeper: Keeper, says: str) -> subprocess.Popen[str]:
    """`script` in a process of its own, given the keeper's socket; once its first line
    begins with `says`."""
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(keeper.socket_path)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *PYTHONPATH])},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().split()[0] == says
    return proc


def writer(keeper: Keeper) -> subprocess.Popen[str]:
    return spawn(WRITER, keeper, "written")


def end(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def reclaim(keeper: Keeper, key: str) -> list[int]:
    reply, fds = protocol.call(str(keeper.socket_path), protocol.ReclaimKV(key), max_fds=2)
    assert isinstance(reply, protocol.KVReclaimed) and len(fds) == 2, reply
    return fds


def test_a_dead_writers_cache_is_adopted_as_it_left_it(keeper: Keeper) -> None:
    proc = writer(keeper)
    end(proc)
    took = adopt(reclaim(keeper, kv_key("writer")), LAYOUT)
    shared = took.shared
    try:
        assert took.entries == [
            Entry("a", [1, 2, 3, 4], [0]),
            Entry("b", list(range(20)), [5, 7]),
        ]
        assert took.held == [9]  # a block its last step wrote for no stream of the ledger
        assert took.writer[0] == proc.pid
        k, v = shared.tensors()
        assert torch.all(k == 1.5) and torch.all(v == -2.0)
        assert shared.meta.pid == os.getpid()  # the writer is this process now
    finally:
        shared.close()


def test_a_stopped_writers_cache_is_not_adopted_until_it_is_dead(keeper: Keeper) -> None:
    proc = writer(keeper)
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        with pytest.raises(NotAdopted, match=f"pid {proc.pid}.* still runs"):
            adopt(reclaim(keeper, kv_key("writer")), LAYOUT)
    finally:
        end(proc)
    took = adopt(reclaim(keeper, kv_key("writer")), LAYOUT)
    took.shared.close()
    assert [e.key for e in took.entries] == ["a", "b"]


def test_a_cache_of_another_layout_is_not_adopted(keeper: Keeper) -> None:
    proc = writer(keeper)
    end(proc)
    other = Layout(2, 12, 16, 2, 8, "float32", "another model")
    with pytest.raises(NotAdopted, match="layout"):
        adopt(reclaim(keeper, kv_key("writer")), other)


def test_a_ledger_that_names_a_block_twice_or_outside_the_cache_is_refused() -> None:
    whole = Slot([Entry("a", [1] * 32, [3, 4]), Entry("b", [2], [5])], [3, 4, 5, 8, 1])
    assert check(whole, LAYOUT) == [1, 8]  # held, and named by no stream
    for bad, says in [
        (Slot([Entry("a", [1], [3]), Entry("b", [2], [3])], []), "named twice"),
        (Slot([Entry("a", [1], [LAYOUT.blocks])], []), "outside"),
        (Slot([Entry("a", [1] * 17, [3])], []), "17 tokens in 1 blocks"),
        (Slot([Entry("a", [1], [3])], [3, LAYOUT.blocks]), "holds a block outside"),
        (Slot([], [-1]), "holds a block outside"),
    ]:
        with pytest.raises(NotAdopted, match=says):
            check(bad, LAYOUT)


def test_an_engine_never_adopts_its_own_cache() -> None:
    shared = SharedKV.create(LAYOUT, 4, 64)
    fds = [os.dup(fd) for fd in shared.fds]
    shared.close()
    with pytest.raises(NotAdopted, match="this engine's own"):
        adopt(fds, LAYOUT)


def test_a_home_without_a_keeper_serves_a_fresh_cache(tmp_path: Path) -> None:
    home = Home(str(tmp_path / "none.sock"), "e1", LAYOUT, 1, 4, 64)
    took, why = home.take_over(kv_key("e0"))
    took.shared.close()
    assert took.entries == [] and took.held == [] and "does not answer" in why


def test_a_standby_adopts_the_cache_it_held_ahead_without_asking_the_keeper(
    keeper: Keeper,
) -> None:
    """A standby holds the primaries' caches the keeper keeps (engine/kvahead.py; one
    round here, the engine runs one every PERIOD_S). Promoted after the writer's death,
    named the cache the keeper held (`Promote.kv_ident`), it adopts the one it holds:
    the keeper is gone by then, so it asked nothing. A cache deposited by an engine that
    is not a primary is not held; a deposit since under a held key is taken again."""
    path = str(keeper.socket_path)
    proc = writer(keeper)  # a primary's cache under kv/writer
    batch = Home(path, "batch", LAYOUT, 1, 4, 64).fresh(primary=False)
    standby = Home(path, "standby", LAYOUT, 1, 4, 64)
    standby.ahead = Ahead(path, standby.key)
    standby.ahead.refresh()
    assert standby.ahead.keys == [kv_key("writer")]
    ident = keeper.kv_ident(kv_key("writer"))
    end(proc)
    keeper.close()
    took, why = standby.claim(kv_key("writer"), ident)
    assert why == "" and took is not None
    assert took.entries[-1] == Entry("b", list(range(20)), [5, 7])
    assert took.writer[0] == proc.pid
    took.shared.close()
    batch.close()


def test_a_cache_held_ahead_that_is_not_the_one_named_is_not_adopted(keeper: Keeper) -> None:
    """The writer deposits again under its key after the standby's round: the promotion
    names the new cache, so the one held is let go and the keeper asked (gone here: no
    adoption, and why)."""
    path = str(keeper.socket_path)
    first = Home(path, "writer", LAYOUT, 1, 4, 64).fresh(primary=True)
    standby = Home(path, "standby", LAYOUT, 1, 4, 64)
    standby.ahead = Ahead(path, standby.key)
    standby.ahead.refresh()
    held = standby.ahead._held[kv_key("writer")][0]
    second = Home(path, "writer", LAYOUT, 1, 4, 64).fresh(primary=True)
    ident = keeper.kv_ident(kv_key("writer"))
    assert ident != held
    keeper.close()
    took, why = standby.claim(kv_key("writer"), ident)
    assert took is None and "does not answer" in why
    assert standby.ahead.keys == []  # promoted: nothing held any more
    first.close()
    second.close()


def test_a_standbys_round_lets_go_of_what_the_keeper_let_go_and_takes_a_new_deposit(
    keeper: Keeper,
) -> None:
    path = str(keeper.socket_path)
    standby = Home(path, "standby", LAYOUT, 1, 4, 64)
    standby.ahead = Ahead(path, standby.key)
    old = Home(path, "e1", LAYOUT, 1, 4, 64).fresh(primary=True)
    standby.ahead.refresh()
    was = standby.ahead._held[kv_key("e1")][0]
    new = Home(path, "e1", LAYOUT, 1, 4, 64).fresh(primary=True)
    own = Home(path, "standby", LAYOUT, 1, 4, 64).fresh(primary=True)  # its own: never held
    standby.ahead.refresh()
    assert standby.ahead.keys == [kv_key("e1")]
    assert standby.ahead._held[kv_key("e1")][0] == keeper.kv_ident(kv_key("e1")) != was
    assert keeper.withdraw_kv(kv_key("e1"))
    standby.ahead.refresh()
    assert standby.ahead.keys == []
    for shared in (old, new, own):
        shared.close()


class ListAllocator:
    """The allocator as a plain list of free ids (what BlockAllocator was): low ids first,
    blocks given back handed out again first."""

    def __init__(self, total: int) -> None:
        self.free = list(range(total - 1, -1, -1))

    def take(self, n: int) -> list[int]:
        return [self.free.pop() for _ in range(n)]

    def give_back(self, blocks: list[int]) -> None:
        self.free.extend(reversed(blocks))

    def reserve(self, blocks: list[int]) -> None:
        self.free = [b for b in self.free if b not in set(blocks)]


def test_the_block_allocator_hands_out_what_a_plain_free_list_would() -> None:
    """Taken, given back and reserved (an adopted cache's blocks) in random order; a
    reserve names free blocks only, as an adoption's do."""
    rng = random.Random(7)
    for _ in range(100):
        total = rng.randint(1, 300)
        got, want = BlockAllocator(total), ListAllocator(total)
        held: list[list[int]] = []
        for _ in range(60):
            roll = rng.random()
            if roll < 0.45 and got.free:
                n = rng.randint(1, got.free)
                held.append(got.take(n))
                assert held[-1] == want.take(n)
            elif roll < 0.6 and want.free:
                blocks = rng.sample(want.free, rng.randint(1, len(want.free)))
                got.reserve(blocks)
                want.reserve(blocks)
                held.append(blocks)
            elif held:
                blocks = held.pop(rng.randrange(len(held)))
                got.give_back(blocks)
                want.give_back(blocks)
            assert got.free == len(want.free) and got.used == total - got.free
    with pytest.raises(EngineError, match="asked for 2 KV blocks with 1 free"):
        BlockAllocator(1).take(2)


# a writer that rewrites its ledger without pause: write i holds i % 10 + 1 entries, each
# with that many tokens, all equal to i, and a block of its own
LOOPING = textwrap.dedent(
    """
    import sys
    from engine.kvshare import Entry, Home, Layout
    layout = Layout(2, 12, 16, 2, 8, "float32", "m")
    shared = Home(sys.argv[1], "writer", layout, 1, 4, 64).fresh(primary=True)
    i = 0
    while True:
        n = i % 10 + 1
        shared.write([Entry(f"s{j}", [i] * n, [j]) for j in range(n)], list(range(n + 1)))
        if i == 0:
            print("writing", flush=True)
        i += 1
    """
)


def test_a_writer_killed_while_it_writes_its_ledger_leaves_a_whole_one(keeper: Keeper) -> None:
    """Killed with SIGKILL wherever its loop is, eight times: what is adopted is always one
    whole write of the ledger."""
    for _ in range(8):
        end(spawn(LOOPING, keeper, "writing"))
        took = adopt(reclaim(keeper, kv_key("writer")), LAYOUT)
        took.shared.close()
        i = took.entries[0].tokens[0]
        n = i % 10 + 1
        assert took.entries == [Entry(f"s{j}", [i] * n, [j]) for j in range(n)]
        assert took.held == [n]


def test_blocks_held_for_a_dead_writer_wait_until_its_exit_is_over() -> None:
    """A stopped process has not exited, however long one waits; killed, it has once it
    is a zombie, before anyone reaps it, and once it is reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        start = start_time(proc.pid)
        assert not wait_exited((proc.pid, start), 0.05)
        os.kill(proc.pid, signal.SIGKILL)
        assert wait_exited((proc.pid, start), 10.0)  # a zombie: not reaped yet
        assert proc.poll() is not None
        assert wait_exited((proc.pid, start), 0.0)
    finally:
        proc.kill()
        proc.wait()


def test_the_ledger_names_every_block_a_step_writes_before_the_step_starts(
    tiny_model: Path,
) -> None:
    """Requests with stream keys and without, joining at different steps: before every
    step, the ledger's held blocks include each block of each request in the step (what
    an adopter keeps from use while the dead engine's last step may still run)."""
    from engine.job import Job
    from engine.kvcache import KVCache
    from engine.modelargs import read_model_args
    from tests.engine.test_engine_batching import build_engine

    engine = build_engine(tiny_model, kv_mb=4)
    args = read_model_args(tiny_model)
    cache = engine.runner.cache
    layout = Layout(
        args.num_hidden_layers,
        cache.blocks,
        cache.block_size,
        args.num_key_value_heads,
        args.head_dim,
        "float32",
        "m",
    )
    shared = SharedKV.create(layout, 16, 512)
    dims = (args.num_hidden_layers, args.num_key_value_heads, args.head_dim)
    engine.runner.cache = KVCache(*dims, 4, torch.float32, "cpu", tensors=shared.tensors())
    engine.shared = shared
    missing: list[set[int]] = []
    step = engine.runner.step

    def observed(plan, **kw):  # type: ignore[no-untyped-def]
        named = set(shared.read().held)
        missing.append({b for seq in plan.seqs for b in seq.blocks} - named)
        return step(plan, **kw)

    engine.runner.step = observed  # type: ignore[method-assign,assignment]
    engine.start()
    try:
        futures = []
        for i in range(6):
            prompt = tuple((5 * i + j) % 200 + 1 for j in range(3 + 11 * i))
            key = f"s{i}" if i % 2 == 0 else ""
            futures.append(engine.submit(Job(prompt, 20 + 7 * i, ignore_eos=True, kv_key=key)))
        for f in futures:
            f.result(timeout=120)
    finally:
        engine.stop_followers()
    assert len(missing) >= 20 and all(not m for m in missing), missing


def test_blocks_a_dead_writers_last_step_may_write_are_not_used_until_it_has_exited(
    tiny_model: Path,
) -> None:
    """An engine takes over a cache whose ledger holds all but 4 blocks for a writer that
    is stopped (SIGSTOP: it has not exited): requests run on the other 4 only, however
    many; once the writer is killed and gone, every block is free again."""
    from engine.batcher import BatchEngine
    from engine.job import Job
    from engine.kvcache import KVCache
    from engine.kvshare import Adopted
    from engine.modelargs import read_model_args
    from tests.engine.test_engine_batching import build_engine

    engine: BatchEngine = build_engine(tiny_model, kv_mb=4)
    args = read_model_args(tiny_model)
    dims = (args.num_hidden_layers, args.num_key_value_heads, args.head_dim)
    total = engine.runner.cache.blocks
    layout = Layout(dims[0], total, 16, dims[1], dims[2], "float32", "m")
    shared = SharedKV.create(layout, 16, 512)
    cache = KVCache(*dims, 4, torch.float32, "cpu", tensors=shared.tensors())
    held = list(range(2, total - 2))  # free: 0, 1 and the last two
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        took = Adopted(shared, [], held, (proc.pid, start_time(proc.pid)))
        engine.take_cache(cache, took).result(timeout=30)
        used: set[int] = set()
        step = engine.runner.step

        def observed(plan, **kw):  # type: ignore[no-untyped-def]
            used.update(b for seq in plan.seqs for b in seq.blocks)
            return step(plan, **kw)

        engine.runner.step = observed  # type: ignore[method-assign,assignment]
        engine.start()
        for i in range(6):  # one after another: 2 blocks each (20 + 10 positions)
            job = Job(tuple(range(1 + i, 21 + i)), 10, ignore_eos=True)
            engine.submit(job).result(timeout=120)
        assert used and used.isdisjoint(held), sorted(used)
        assert engine.scheduler.allocator.free == total - len(held)
        proc.kill()
        proc.wait()
        deadline = 600  # polls of the model thread's allocator, 0.05 s apart
        while engine.scheduler.allocator.free != total and deadline:
            deadline -= 1
            engine.wake()
            threading.Event().wait(0.05)
        assert engine.scheduler.allocator.free == total
    finally:
        proc.kill()
        proc.wait()
        engine.stop_followers()


# a dead primary's cache for the tiny model: one stream's ledger entry, 40 positions in
# blocks 0-2 (their keys and values zero: what the continuation computes is not checked)
DEAD = textwrap.dedent(
    """
    import sys, time
    from engine.kvshare import Entry, Home, Layout
    layout = Layout(*(int(x) for x in sys.argv[2].split(",")[:5]), "float32", "m")
    shared = Home(sys.argv[1], "dead", layout, 4, 16, 512).fresh(primary=True)
    shared.write([Entry("s1", list(range(1, 41)), [0, 1, 2])], [0, 1, 2])
    print("written", flush=True)
    time.sleep(600)
    """
)


def dead_primary(keeper: Keeper, tiny_model: Path) -> tuple[subprocess.Popen[str], Layout]:
    """A process that has deposited DEAD's cache (a layout of the tiny model's) with
    `keeper` and waits; and that layout."""
    from engine.kvcache import BLOCK_SIZE, blocks_in
    from engine.modelargs import read_model_args

    args = read_model_args(tiny_model)
    dims = (args.num_hidden_layers, args.num_key_value_heads, args.head_dim)
    blocks = blocks_in(4, *dims, torch.float32, BLOCK_SIZE)
    layout = Layout(dims[0], blocks, BLOCK_SIZE, dims[1], dims[2], "float32", "m")
    spec = ",".join(str(x) for x in (dims[0], blocks, BLOCK_SIZE, dims[1], dims[2]))
    proc = subprocess.Popen(
        [sys.executable, "-c", DEAD, str(keeper.socket_path), spec],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *PYTHONPATH])},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().split()[0] == "written"
    return proc, layout


def test_a_continuation_sent_before_the_promoted_engines_swap_is_admitted_to_the_adopted_cache(
    keeper: Keeper, tiny_model: Path
) -> None:
    """The promotion is acknowledged before the swap to the adopted cache (which waits for
    the model thread, busy here): a continuation arriving meanwhile, longer than the
    standby's own small cache holds, is admitted, is told the 40 positions the adopted
    cache keeps of it, and computes only what comes after them."""
    from engine.job import Job, Step
    from tests.engine.test_engine_batching import build_engine

    proc, layout = dead_primary(keeper, tiny_model)
    end(proc)

    engine = build_engine(tiny_model, kv_mb=4)
    home = Home(str(keeper.socket_path), "standby", layout, 4, 16, 512)
    small = home.standby_cache(32)  # 2 blocks of its own: the continuation needs 10
    engine.runner.cache = small
    engine.scheduler.allocator = BlockAllocator(small.usable)
    engine.home = home
    gate = threading.Event()
    engine.start()
    try:
        busy = engine.between_steps(lambda: gate.wait(60), forget=False)  # the model thread
        assert engine.promoted_cache(kv_key("dead")) == (1, "")
        prompt = tuple(range(1, 42))  # the 40 kept, then the last token its client got
        steps: list[Step] = []
        job = Job(prompt, 100, ignore_eos=True, warm_key="s1", kv_key="s1")
        future = engine.submit(job, steps.append)
        assert engine.runner.cache is small  # nothing swapped yet
        gate.set()
        busy.result(timeout=60)
        assert len(future.result(timeout=120).tokens) == 100
        # its first step says so (the engine's KEPT_HEADER); no other step does
        assert [s.kept for s in steps[:2]] == [40, 0]
        assert engine.runner.cache is not small
        assert engine.stats().reused_tokens == 40  # prompt positions the adopted prefix spared
    finally:
        gate.set()
        engine.stop_followers()


def test_no_step_runs_on_the_standbys_cache_from_the_promotion_to_the_swap(
    keeper: Keeper, tiny_model: Path
) -> None:
    """A standby runs a probe when it is promoted; the dead primary's writer is stopped
    (SIGSTOP), so the claim waits for it (WRITER_GONE_S) and then takes a fresh cache.
    While the claim waits, the probe's next step does not run: it ends as cancelled at the
    swap, and no step began between the promotion and the swap."""
    from engine.job import Job, Step
    from tests.engine.test_engine_batching import build_engine

    proc, layout = dead_primary(keeper, tiny_model)
    os.kill(proc.pid, signal.SIGSTOP)  # fenced, not dead: its cache is not adopted

    engine = build_engine(tiny_model, kv_mb=4)
    home = Home(str(keeper.socket_path), "standby", layout, 4, 16, 512)
    small = home.standby_cache(32)
    engine.runner.cache = small
    engine.scheduler.allocator = BlockAllocator(small.usable)
    engine.home = home
    events: list[str] = []
    step = engine.runner.step

    def observed(plan, **kw):  # type: ignore[no-untyped-def]
        events.append("step" if engine.runner.cache is small else "step on the new cache")
        return step(plan, **kw)

    engine.runner.step = observed  # type: ignore[method-assign,assignment]
    gate, first = threading.Event(), threading.Event()

    def on_step(_: Step) -> None:
        if not first.is_set():  # hold the model thread before the probe's next step
            first.set()
            engine.between_steps(lambda: gate.wait(60), forget=False)

    engine.start()
    try:
        probe = engine.submit(Job((5, 17, 99, 3), 28, ignore_eos=True), on_step)
        assert first.wait(60)
        result: list[tuple[int | None, str]] = []
        promoting = threading.Thread(
            target=lambda: result.append(engine.promoted_cache(kv_key("dead")))
        )
        events.append("promoted")
        promoting.start()
        for _ in range(60_000):  # the promotion has begun: its pending cache is set
            if engine.kv_pending:
                break
            threading.Event().wait(0.001)
        assert engine.kv_pending
        gate.set()  # the model thread is free while the claim still waits for the writer
        promoting.join(60)
        assert result and result[0][0] is None and "still runs" in result[0][1], result
        generation = probe.result(timeout=60)
        assert generation.finish_reason == "cancelled" and len(generation.steps) < 28
        assert engine.runner.cache is not small
        assert "step" not in events[events.index("promoted") :], events
    finally:
        gate.set()
        engine.stop_followers()
        os.kill(proc.pid, signal.SIGCONT)
        end(proc)
