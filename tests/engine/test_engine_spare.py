"""Spares of the engine fork server (engine.spare), on the CPU (`--spares on`): a spare
warms up ahead, the next request like the last one is handed to it, it serves the tokens a
fresh fork serves, and an unclaimed spare never outlives its server. Ready spares
(`--spares ready`, engine.ready): the engine that claims one builds nothing, serves what a
fresh fork serves, and drops the build when the checkpoint's files changed since."""

from __future__ import annotations

import contextlib
import json
import os
import select
from collections.abc import Iterator
from pathlib import Path

from conftest import Daemons, ForkServerProc

from engine.launch import EngineProcess
from tests.engine.test_engine_forkserver import complete, disk_flags


@contextlib.contextmanager
def spares_server(
    tmp_path: Path, mode: str
) -> Iterator[tuple[ForkServerProc, list[EngineProcess]]]:
    """A fork server with `--spares mode`, ready, and a list for the engines a test starts
    from it; all of them killed, and the server stopped, at the end."""
    server = ForkServerProc(tmp_path / "forkserver.sock", "--spares", mode)
    engines: list[EngineProcess] = []
    try:
        server.wait_ready()
        yield server, engines
    finally:
        for e in engines:
            e.proc.kill()
            e.exited.wait(30)
        server.stop()


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
    with spares_server(tmp_path, "on") as (server, engines):
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


def test_the_next_version_of_a_model_takes_the_spare_its_last_version_left(
    tmp_path: Path, tiny_model: Path, next_model: Path
) -> None:
    """An update's engine (a checkpoint of the same shapes in another dir) is handed the
    spare the old version's engine left, and serves the new weights, as a fresh fork of
    them does."""
    with spares_server(tmp_path, "on") as (server, engines):
        engines.append(EngineProcess(disk_flags(tiny_model), forkserver=server.sock))
        engines[0].wait_ready()
        (warm,) = spare_pids(server, "spare warm", 1)
        prompt = [1, 2, 3]
        old = complete(engines[0].url, prompt)
        engines.append(EngineProcess(disk_flags(next_model), forkserver=server.sock))
        ready = engines[1].wait_ready()
        assert engines[1].proc.pid == warm and ready["phases"]["spare"] > 0
        new = complete(engines[1].url, prompt)
        assert new != old
        engines.append(
            EngineProcess([*disk_flags(next_model), "--max-batch", "4"], forkserver=server.sock)
        )
        engines[2].wait_ready()  # other settings: a fresh fork of the same weights
        assert complete(engines[2].url, prompt) == new


def test_a_request_with_other_settings_forks_and_replaces_the_spare(
    tmp_path: Path, tiny_model: Path
) -> None:
    with spares_server(tmp_path, "on") as (server, engines):
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


def test_a_ready_spare_is_claimed_built_and_serves_the_tokens_of_a_fresh_fork(
    tmp_path: Path, tiny_model: Path
) -> None:
    """`--spares ready`: the spare attaches, allocates and warms before it is asked; the
    engine that claims it builds nothing (its build, attach and warm-up phases are 0)."""
    with spares_server(tmp_path, "ready") as (server, engines):
        first = EngineProcess(disk_flags(tiny_model), forkserver=server.sock)
        engines.append(first)
        fresh = first.wait_ready()["phases"]
        assert fresh["spare"] == 0 and fresh["attach"] > 0
        (warm,) = spare_pids(server, "spare warm", 1)
        prompts = ([1, 2, 3], [200, 17, 5, 9])
        want = [complete(first.url, p) for p in prompts]

        second = EngineProcess(disk_flags(tiny_model), forkserver=server.sock)
        engines.append(second)
        phases = second.wait_ready()["phases"]
        assert second.proc.pid == warm
        assert phases["spare"] > 0
        assert phases["context_init"] == phases["build"] == phases["attach"] == 0
        assert phases["warmup"] == 0
        assert "spare's build not used" not in "".join(second.lines)
        assert [complete(second.url, p) for p in prompts] == want
        assert [complete(first.url, p) for p in prompts] == want  # both serve at once


def test_a_ready_spare_built_from_files_since_changed_is_not_used(
    tmp_path: Path, tiny_model: Path
) -> None:
    """The checkpoint's files rewritten in place (same shapes, other values) between the
    spare's build and its claim: the claiming engine drops what the spare built, says why,
    and serves the new weights, as an engine started afresh on them does."""
    import shutil

    from cachedaemon.checkpoint_gen import make_checkpoint

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    other = make_checkpoint(tmp_path / "other", "tiny", seed=7)
    with spares_server(tmp_path, "ready") as (server, engines):
        engines.append(EngineProcess(disk_flags(model), forkserver=server.sock))
        engines[0].wait_ready()
        (warm,) = spare_pids(server, "spare warm", 1)
        old = complete(engines[0].url, [1, 2, 3])
        for f in other.glob("*.safetensors"):
            shutil.copyfile(f, model / f.name)  # rewritten in place: same names and shapes

        claimed = EngineProcess(disk_flags(model), forkserver=server.sock)
        engines.append(claimed)
        phases = claimed.wait_ready()["phases"]
        assert claimed.proc.pid == warm and phases["attach"] > 0
        assert "the checkpoint's files changed since the spare was built" in "".join(claimed.lines)
        fresh = EngineProcess(disk_flags(model))
        engines.append(fresh)
        fresh.wait_ready()
        new = complete(claimed.url, [1, 2, 3])
        assert new == complete(fresh.url, [1, 2, 3])
        assert new != old  # the test's two checkpoints answer apart


def test_a_ready_spare_attached_to_a_daemon_becomes_an_engine_of_another_name(
    tmp_path: Path, tiny_model: Path, start_daemon: Daemons
) -> None:
    """Weights from a daemon's pool: the spare attached them before it was asked; the engine
    it becomes, under its own name and port, serves them with no attach of its own."""
    start_daemon(tiny_model, tmp_path / "run", "--dtype", "float32")
    sock = tmp_path / "run" / "daemon-0.sock"
    flags = ["--model", str(tiny_model), "--dtype", "float32", "--daemons", str(sock)]
    with spares_server(tmp_path, "ready") as (server, engines):
        engines.append(EngineProcess([*flags, "--name", "first"], forkserver=server.sock))
        assert engines[0].wait_ready()["weights"] == "daemon"
        (warm,) = spare_pids(server, "spare warm", 1)
        engines.append(EngineProcess([*flags, "--name", "second"], forkserver=server.sock))
        ready = engines[1].wait_ready()
        assert engines[1].proc.pid == warm
        assert ready["engine"] == "second" and ready["weights"] == "daemon"
        assert ready["port"] == engines[1].port != engines[0].port
        assert ready["phases"]["attach"] == 0 and ready["phases"]["spare"] > 0
        assert complete(engines[1].url, [4, 5, 6]) == complete(engines[0].url, [4, 5, 6])
