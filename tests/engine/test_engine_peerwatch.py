"""A standalone tensor-parallel group (real processes, gloo) ends when a rank dies or stops.

gloo notices a closed socket only when a collective runs, and a stopped peer never; these
groups are idle, so only the peer watch can end them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.launch import EngineProcess
from holdfast_contract.wire import free_port

STALE_S = 2.0
ROOT = Path(__file__).resolve().parents[2]


def lost_lines(proc: EngineProcess) -> list[dict[str, Any]]:
    return proc.events("tensor-parallel peer lost; exiting")


@pytest.fixture
def pair(tiny_model: Path) -> Iterator[tuple[EngineProcess, EngineProcess]]:
    """An idle tp=2 group, both ranks ready; every rank is gone after the test."""
    tp = [
        *("--model", str(tiny_model), "--allow-disk-fallback", "--world-size", "2"),
        *("--peer-stale-s", str(STALE_S), "--dist-init", f"tcp://127.0.0.1:{free_port()}"),
    ]
    lead = EngineProcess([*tp, "--rank", "0"])
    follower = EngineProcess([*tp, "--rank", "1"], port=lead.port)
    try:
        lead.wait_ready()
        follower.wait_ready()
        yield lead, follower
    finally:
        for p in (lead, follower):
            if p.proc.poll() is None:
                p.proc.kill()
                os.kill(p.proc.pid, signal.SIGCONT)  # a stopped process dies only once running
            p.stop()


def test_rank_0_exits_3_when_its_idle_follower_is_killed(
    pair: tuple[EngineProcess, EngineProcess],
) -> None:
    lead, follower = pair
    follower.proc.kill()
    t0 = time.monotonic()
    assert lead.wait_exit(STALE_S + 8) == 3
    assert time.monotonic() - t0 >= STALE_S / 2  # judged stale, not on the first miss
    [line] = lost_lines(lead)
    assert line["peer"] == 1 and "heartbeat unchanged" in line["reason"]


def test_the_follower_exits_3_when_rank_0_is_stopped(
    pair: tuple[EngineProcess, EngineProcess],
) -> None:
    lead, follower = pair
    os.kill(lead.proc.pid, signal.SIGSTOP)
    assert follower.wait_exit(STALE_S + 8) == 3
    [line] = lost_lines(follower)
    assert line["peer"] == 0 and "silent" in line["reason"]


def test_an_idle_group_stays_up_and_sigterm_stops_both_cleanly(
    pair: tuple[EngineProcess, EngineProcess],
) -> None:
    lead, follower = pair
    assert not lead.exited.wait(3 * STALE_S)  # live peers are never judged stale
    assert not follower.exited.is_set()
    lead.proc.terminate()
    assert (lead.wait_exit(30), follower.wait_exit(30)) == (0, 0)
    assert lost_lines(lead) == lost_lines(follower) == []
    assert "did not mark their stop" not in lead.log


def test_a_peer_that_never_writes_its_key_ends_the_rank_with_exit_3() -> None:
    """Rank 1 never comes up: rank 0's watch names it once `appear_s` has passed."""
    from datetime import timedelta

    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=30))
    code = (
        "import time\n"
        "from engine.peerwatch import PeerWatch\n"
        f"w = PeerWatch(('127.0.0.1', {port}), 0, 2, interval_s=0.1, stale_s=2, appear_s=1)\n"
        "w.start()\n"
        "time.sleep(30)\n"
    )
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert done.returncode == 3, done.stderr[-2000:]
    assert 1 <= time.monotonic() - t0 < 30
    assert "never wrote holdfast/peerwatch/1 in 1 s" in done.stdout + done.stderr
    assert store.get("holdfast/peerwatch/0")  # it beat while it waited
