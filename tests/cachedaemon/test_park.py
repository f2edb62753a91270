"""`cachedaemon park`: a daemon that imports and waits, then serves the command line a
claim hands it, writing to the claim's log; a claim that does not parse ends it with
exit 2 and no answer, and a claim where nothing is parked gets None."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from cachedaemon import park, protocol


def parked(tmp_path: Path) -> tuple[subprocess.Popen[bytes], Path]:
    sock = tmp_path / "parked.sock"
    with open(tmp_path / "parked.log", "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cachedaemon",
                "--log-format",
                "json",
                "park",
                "--claim",
                str(sock),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 60
    while '"parked"' not in (tmp_path / "parked.log").read_text():
        assert proc.poll() is None and time.monotonic() < deadline, (
            tmp_path / "parked.log"
        ).read_text()
        time.sleep(0.05)
    return proc, sock


def test_a_claim_makes_the_parked_daemon_serve_its_command_line(
    tmp_path: Path, tiny_model: Path
) -> None:
    proc, sock = parked(tmp_path)
    try:
        run, log = tmp_path / "run", tmp_path / "daemon.log"
        argv = ["--log-format", "json", "serve", "--model", str(tiny_model)]
        argv += ["--device", "cpu", "--runtime-dir", str(run)]
        assert park.claim(sock, argv, log) == proc.pid
        deadline = time.monotonic() + 60
        while not (run / "daemon-0.sock").exists() or "serving" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        reply, _ = protocol.call(str(run / "daemon-0.sock"), protocol.StatusRequest())
        assert isinstance(reply, protocol.StatusReply) and reply.pid == proc.pid
        assert not sock.exists()  # claimed once: nothing is parked there any more
        assert park.claim(sock, argv, log) is None
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_claim_that_does_not_parse_ends_the_parked_daemon(tmp_path: Path) -> None:
    proc, sock = parked(tmp_path)
    try:
        assert park.claim(sock, ["status", "--socket", "x"], tmp_path / "daemon.log") is None
        assert proc.wait(timeout=30) == 2
        assert "a parked daemon runs `serve`" in (tmp_path / "parked.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
