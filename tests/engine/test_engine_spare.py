"""Spares of the engine fork server (engine.spare), on the CPU (`--spares on`): a spare
warms up ahead, the next request like the last one is handed to it, it serves the tokens a
fresh fork serves, and an unclaimed spare never outlives its server."""

from __future__ import annotations

import json
import os
import select
from pathlib import Path

from conftest import ForkServerProc

from engine.launch import EngineProcess
from tests.engine.test_engine_forkserver import complete, disk_flags


def spare_pids(server: ForkServerProc, event: str, count: int) -> list[int]:
    """The pids of the server's first `count` `event` log events ("spare warm", ...)."""
    lines = server.wait_for(f'"event": "{event}"', 120, count=count)
    return [json.loads(line)["pid"] for line in lines[:count]]


def wait_gone(pid: int) -> None:
    """Until `pid` has exited: AssertionError if it is still alive after a minute."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        ready, _, _ = select.select([fd], [], [], 60)
        assert ready, f"process {pid} still alive"
    finally:
        os.close(fd)


def test_the_next_request_takes_the_warm_spare_and_serves_the_same_tokens(
    tmp_path: Path, tiny_model: Path
) -> None:
    server = ForkServerProc(tmp_path / "forkserver.sock", "--spares", "on")
    engines: list[EngineProcess] = []
    try:
        server.wait_ready()
        first = EngineProcess(disk_flags(tiny_model), forkserver=server.sock)
        engines.append(first)
        assert first.wait_ready()["phases"]["spare"] == 0  # none existed: a fresh fork
        (warm,) = spare_pids(server, "spare warm", 1)
        prompts = ([1, 2, 3], [200, 17, 5, 9])
        want = [complete(first.url, p) for p in prompts]
        assert first.stop() == 0

        second = EngineProcess(disk_flags(tiny_model), forkserver=server.sock)
        engines.append(second)
        ready = second.wait_ready()
        assert second.proc.pid == warm
        assert ready["phases"]["spare"] > 0
        assert os.getpgid(warm) == warm  # a session of its own, as a fork has
        assert [complete(second.url, p) for p in prompts] == want

        # its claim forked the next spare; the server's death takes that one, not the engine
        _, unclaimed = spare_pids(server, "spare forked", 2)
        spare_pids(server, "spare warm", 2)
        server.proc.kill()
        server.proc.wait()
        wait_gone(unclaimed)
        assert [complete(second.url, p) for p in prompts] == want
    finally:
        for e in engines:
            e.proc.kill()
            e.exited.wait(30)
        server.stop()


def test_a_request_with_other_settings_forks_and_replaces_the_spare(
    tmp_path: Path, tiny_model: Path
) -> None:
    server = ForkServerProc(tmp_path / "forkserver.sock", "--spares", "on")
    engines: list[EngineProcess] = []
    try:
        server.wait_ready()
        engines.append(EngineProcess(disk_flags(tiny_model), forkserver=server.sock))
        engines[0].wait_ready()
        (old,) = spare_pids(server, "spare warm", 1)
        other = [*disk_flags(tiny_model), "--max-batch", "4"]
        engines.append(EngineProcess(other, forkserver=server.sock))
        ready = engines[1].wait_ready()
        assert engines[1].proc.pid != old and ready["phases"]["spare"] == 0
        wait_gone(old)  # dropped: one spare per device, made for the latest settings
        assert "another request's settings" in server.log
        _, new = spare_pids(server, "spare warm", 2)
        engines.append(EngineProcess(other, forkserver=server.sock))
        engines[2].wait_ready()
        assert engines[2].proc.pid == new
        assert complete(engines[2].url, [5, 6]) == complete(engines[1].url, [5, 6])
    finally:
        for e in engines:
            e.proc.kill()
            e.exited.wait(30)
        server.stop()
