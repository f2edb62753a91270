"""holdfast_fork's server on its own: it forks any program, neither engine kind imported."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import LoggedProc

from holdfast_contract import forkserver as fs
from holdfast_contract.errors import ForkServerError

# a fork server whose forks write their flags and exit with their count, and which says
# which of the engine kinds (and torch) it has imported before it serves
SERVER = """
import sys
from pathlib import Path

from holdfast_fork.listener import bind
from holdfast_fork.server import Server


def program(argv, t0, spare_ms):
    print("forked", *argv, flush=True)
    return len(argv)


server = Server(bind(Path(sys.argv[1])), program)
heavy = sorted(m for m in ("engine", "holdfast_vllm", "torch") if m in sys.modules)
print("serving, imported:", *heavy or ["none"], file=sys.stderr, flush=True)
server.loop()
"""


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[LoggedProc, Path]]:
    sock = tmp_path / "fork.sock"
    proc = LoggedProc([sys.executable, "-c", SERVER, str(sock)])
    try:
        proc.wait_for("serving", 60)
        yield proc, sock
    finally:
        proc.stop()


def test_a_fork_runs_the_servers_program_without_either_engine(
    server: tuple[LoggedProc, Path], tmp_path: Path
) -> None:
    proc, sock = server
    assert "serving, imported: none" in proc.log
    out = tmp_path / "out"
    with open(os.devnull, "rb") as null, out.open("wb") as w:
        spawn = fs.Spawn(argv=["a", "b", "c"], env={"X": "1"}, cwd=str(tmp_path), owner=0)
        conn, pid = fs.request(sock, spawn, [null.fileno(), w.fileno(), w.fileno()])
    with conn:
        assert pid > 0 and pid != proc.proc.pid
        conn.settimeout(30)
        assert fs.read_reply(conn) == fs.Exited(3)
    assert out.read_text() == "forked a b c\n"


def test_a_request_without_its_three_fds_is_refused(server: tuple[LoggedProc, Path]) -> None:
    _, sock = server
    with open(os.devnull, "rb") as null:
        spawn = fs.Spawn(argv=[], env={}, cwd="/", owner=0)
        with pytest.raises(ForkServerError, match="send stdin, stdout and stderr as 3 fds, not 1"):
            fs.request(sock, spawn, [null.fileno()])
