"""The one Watcher every process kind plugs into, on real processes, and the engine kind
registry."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

from supervisor import kinds
from supervisor.kinds import base, vllm
from supervisor.policy import EnginesSpec, Policy
from supervisor.units import Incarnation
from supervisor.watcher import Command, Watcher, not_ready, until_ready

PY = sys.executable


def cmd(tmp_path: Path, code: str, name: str = "p") -> Command:
    return Command([PY, "-c", code], {}, tmp_path / f"{name}.log")


def test_the_built_in_engine_kinds_are_registered_with_their_probes() -> None:
    registry = kinds.registry()
    assert {"holdfast", "vllm"} <= set(registry)
    assert kinds.known("holdfast") == [] and kinds.known("nope")[0].startswith(
        "$.engines.kind: got 'nope', expected one of 'holdfast', 'vllm'"
    )
    agent = Policy()
    http = Policy(engines=EnginesSpec(kind="vllm", health="http"))
    assert registry["vllm"].probes(http) == (base.http_health, vllm.watch_load)
    assert registry["holdfast"].probes(agent) == ()
    assert base.HEALTH["http"] == (base.http_health,)


def test_one_rank_exiting_takes_its_group_and_is_reported_once(tmp_path: Path) -> None:
    async def go() -> None:
        w = Watcher()
        procs = [
            await w.spawn(cmd(tmp_path, "import time; time.sleep(600)", "r0")),
            await w.spawn(cmd(tmp_path, "import time; time.sleep(600)", "r1")),
        ]
        inc = Incarnation(procs)
        seen: list[tuple[int, int | None]] = []
        reported = asyncio.Event()

        def on_exit(rank: int, code: int | None) -> None:
            seen.append((rank, code))
            reported.set()

        w.watch(inc, on_exit)
        procs[1].kill_group(signal.SIGTERM)
        async with asyncio.timeout(30):
            await reported.wait()
        assert seen == [(1, -signal.SIGTERM)]
        assert not procs[0].alive  # one_for_all: rank 0's group was killed as well
        await w.stop()
        assert not w.tasks

    asyncio.run(go())


def test_a_handled_end_is_not_reported_and_stop_cancels_the_watch(tmp_path: Path) -> None:
    async def go() -> None:
        w = Watcher()
        sleeper = "import time; time.sleep(600)"
        inc = Incarnation([await w.spawn(cmd(tmp_path, sleeper))])
        seen: list[int] = []
        w.watch(inc, lambda rank, code: seen.append(rank), one_for_all=False)
        inc.handled = True  # (as Crew.down or CacheDaemons.exited do)
        assert await inc.procs[0].fence()
        async with asyncio.timeout(30):
            await asyncio.gather(*w.tasks)  # the watch ends by itself
        assert seen == [] and not w.tasks
        later = Incarnation([await w.spawn(cmd(tmp_path, sleeper, "later"))])
        w.watch(later, lambda rank, code: seen.append(rank))
        await w.stop()  # the watch is cancelled: the process is not waited for any more
        assert not w.tasks and later.procs[0].alive
        await later.procs[0].fence()
        assert seen == []

    asyncio.run(go())


def test_ready_when_the_file_appears_not_when_the_process_dies_first(tmp_path: Path) -> None:
    async def go() -> None:
        ready = tmp_path / "unit.ready"
        writer = await Watcher.spawn(
            cmd(tmp_path, f"import time; time.sleep(0.2); open({str(ready)!r}, 'w').close()")
        )
        assert await until_ready(tmp_path, ready.exists, 60, unless=None)
        await writer.wait()
        dies = await Watcher.spawn(cmd(tmp_path, "raise SystemExit(3)", "dies"))
        never = tmp_path / "never.ready"
        assert not await until_ready(tmp_path, never.exists, 60, unless=dies)
        assert not await until_ready(tmp_path, never.exists, 0.05)

    asyncio.run(go())


def test_not_ready_says_how_it_died_with_its_log_tail(tmp_path: Path) -> None:
    async def go() -> None:
        code = "import sys; print('ValueError: no such checkpoint', file=sys.stderr); sys.exit(3)"
        c = cmd(tmp_path, code, "unit")
        inc = Incarnation([await Watcher.spawn(c)])
        await inc.procs[0].wait()
        why = await not_ready("cache daemon rank 0", inc, c.log, ("serve", "served"), "x")
        assert why.startswith("cache daemon rank 0 died ")
        assert "before it served (exit status 3)" in why
        assert f"its last log lines ({c.log}):\nValueError: no such checkpoint" in why
        alive = Incarnation([await Watcher.spawn(cmd(tmp_path, "import time; time.sleep(600)"))])
        why = await not_ready("unit", alive, c.log, ("serve", "served"), "its.timeout_s (1 s)")
        assert why.startswith(f"unit (pid {alive.pid}) did not serve within its.timeout_s (1 s)")
        await alive.procs[0].fence()

    asyncio.run(go())
