"""The engine fork server: forked engines serve like exec'd ones, report their exit, die with
their owner, outlive the server; bad requests are refused and the server keeps serving."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from conftest import ForkServerProc, child_env

from engine.errors import EngineError
from engine.launch import EngineProcess
from holdfast_contract import forkserver as fs
from holdfast_contract.errors import ForkServerError
from supervisor.errors import PolicyError
from supervisor.policy_file import load_policy
from tests.as_user import as_user


def complete(url: str, prompt: list[int]) -> list[int]:
    body = json.dumps({"prompt_token_ids": prompt, "max_tokens": 8, "ignore_eos": True})
    req = urllib.request.Request(url + "/v1/completions", data=body.encode(), method="POST")
    with urllib.request.urlopen(req, timeout=60) as resp:
        ids: list[int] = json.loads(resp.read())["choices"][0]["token_ids"]
    return ids


def disk_flags(model: Path) -> list[str]:
    return ["--model", str(model), "--dtype", "float32", "--allow-disk-fallback"]


def test_forked_engine_serves_the_tokens_of_an_execd_one(
    forkserver: ForkServerProc, tiny_model: Path
) -> None:
    forked = EngineProcess(disk_flags(tiny_model), forkserver=forkserver.sock)
    execd = EngineProcess(disk_flags(tiny_model))
    try:
        f, e = forked.wait_ready(), execd.wait_ready()
        assert f["phases"]["imports"] < e["phases"]["imports"]  # done once, in the server
        assert os.getpgid(forked.proc.pid) == forked.proc.pid  # a session of its own
        for prompt in ([1, 2, 3], [200, 17, 5]):
            assert complete(forked.url, prompt) == complete(execd.url, prompt)
        assert forked.stop() == 0  # SIGTERM drains, exit code from the server
    finally:
        forked.stop()
        execd.stop()


def test_kill_is_reported_and_the_server_keeps_forking(
    forkserver: ForkServerProc, tiny_model: Path
) -> None:
    first = EngineProcess(disk_flags(tiny_model), forkserver=forkserver.sock)
    first.wait_ready()
    first.proc.kill()
    assert first.wait_exit(30) == -signal.SIGKILL
    second = EngineProcess(disk_flags(tiny_model), forkserver=forkserver.sock)
    try:
        second.wait_ready()
        assert complete(second.url, [4, 5])
    finally:
        second.stop()


def test_engine_dies_with_its_owner(forkserver: ForkServerProc, tiny_model: Path) -> None:
    owner = subprocess.Popen(["sleep", "120"])
    r, w = os.pipe()
    null = os.open(os.devnull, os.O_RDWR)
    spawn = fs.Spawn(argv=disk_flags(tiny_model), env=child_env(), cwd=os.getcwd(), owner=owner.pid)
    try:
        sock, pid = fs.request(forkserver.sock, spawn, [null, null, w])
    finally:
        os.close(w)
        os.close(null)
    with os.fdopen(r) as err:
        owner.kill()
        owner.wait()
        sock.settimeout(30)
        assert fs.read_reply(sock) == fs.Exited(-signal.SIGKILL)
        err.read()
    sock.close()


def test_engines_outlive_a_dead_server(tmp_path: Path, tiny_model: Path) -> None:
    own = ForkServerProc(tmp_path / "forkserver.sock")
    own.wait_ready()
    engine = EngineProcess(disk_flags(tiny_model), forkserver=own.sock)
    try:
        engine.wait_ready()
        own.proc.kill()
        own.proc.wait(10)
        assert complete(engine.url, [9, 8, 7])
        with pytest.raises(EngineError, match="fork server gone"):
            engine.proc.wait(10)
    finally:
        engine.proc.kill()
        assert engine.exited.wait(30)
        own.stop()


def test_bad_engine_flags_exit_2_naming_the_flag(
    forkserver: ForkServerProc, tiny_model: Path
) -> None:
    bad = EngineProcess([*disk_flags(tiny_model), "--world-size", "0"], forkserver=forkserver.sock)
    assert bad.wait_exit(60) == 2
    assert "--world-size" in bad.log


def raw_request(path: Path, payload: bytes, fds: list[int]) -> Any:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(path))
        socket.send_fds(sock, [payload], fds)
        try:
            return fs.read_reply(sock)
        except ForkServerError:
            return None  # closed without a reply


def test_bad_requests_are_refused_and_the_server_keeps_serving(
    forkserver: ForkServerProc, tiny_model: Path
) -> None:
    spawn = fs.Spawn(argv=disk_flags(tiny_model), env=child_env(), cwd=os.getcwd())
    null = os.open(os.devnull, os.O_RDWR)
    try:
        reply = raw_request(forkserver.sock, fs.frame(spawn), [null])
        assert reply == fs.Refused("send stdin, stdout and stderr as 3 fds, not 1")
        garbage = struct.pack(">I", 5) + b"\xc1\xc1\xc1\xc1\xc1"
        reply = raw_request(forkserver.sock, garbage, [null, null, null])
        assert isinstance(reply, fs.Refused)
        oversized = struct.pack(">I", fs.MAX_FRAME + 1)
        reply = raw_request(forkserver.sock, oversized, [null, null, null])
        assert (
            isinstance(reply, fs.Refused)
            and f"exceeds the {fs.MAX_FRAME}-byte cap" in reply.message
        )
    finally:
        os.close(null)
    ok = EngineProcess(disk_flags(tiny_model), forkserver=forkserver.sock)
    try:
        ok.wait_ready()
    finally:
        ok.stop()


def test_a_second_server_on_the_same_socket_is_refused(forkserver: ForkServerProc) -> None:
    cp = subprocess.run(
        [sys.executable, "-m", "engine.forkserver", "--socket", str(forkserver.sock)],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=120,
    )
    assert cp.returncode == 2
    assert f"a fork server already listens on {forkserver.sock}" in cp.stderr
    assert forkserver.proc.poll() is None and forkserver.sock.exists()


def test_no_server_is_an_error_naming_the_socket(tmp_path: Path, tiny_model: Path) -> None:
    with pytest.raises(EngineError, match=f"fork server at {tmp_path}/none.sock"):
        EngineProcess(disk_flags(tiny_model), forkserver=tmp_path / "none.sock")


def test_policy_forkserver_true_needs_the_engine_command(tmp_path: Path, tiny_model: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        f"model: {{path: {tiny_model}}}\n"
        "engines: {forkserver: true, command: [/bin/sleep, '100']}\n"
    )
    with pytest.raises(PolicyError, match=r"\$\.engines\.forkserver: true needs engines.command"):
        load_policy(policy)


@pytest.mark.skipif(os.getuid() != 0, reason="switching uid needs root")
def test_a_peer_of_another_uid_reads_why_it_is_refused(tiny_model: Path) -> None:
    """Its request is read before the refusal, so it gets the reason, never a broken pipe."""
    nobody = 65534
    home = Path(tempfile.mkdtemp(prefix="holdfast-fs-"))  # /tmp: every user can reach it
    os.chmod(home, 0o755)
    server = ForkServerProc(home / "forkserver.sock")
    try:
        server.wait_ready()
        os.chmod(server.sock, 0o777)  # only the server's own uid check stands in the way
        said = _ask_as(nobody, server.sock, tiny_model)
    finally:
        server.stop()
        shutil.rmtree(home, ignore_errors=True)
    assert said == f"peer uid {nobody} is not this fork server's uid 0; connect as that user"


def _ask_as(uid: int, sock: Path, tiny_model: Path) -> str:
    """What the fork server at `sock` answers a whole request sent by a process of `uid`."""
    spawn = fs.Spawn(argv=disk_flags(tiny_model), env=child_env(), cwd=os.getcwd())

    def ask() -> str:  # the peer sends a whole request with its 3 fds
        null = os.open(os.devnull, os.O_RDWR)
        reply = raw_request(sock, fs.frame(spawn), [null, null, null])
        return reply.message if isinstance(reply, fs.Refused) else repr(reply)

    said: str = as_user(uid, ask)
    return said


def test_a_later_fork_finds_the_tokenizer_read_by_the_server(
    tmp_path: Path, tiny_model: Path
) -> None:
    """After its first request for a model the fork server reads that model's tokenizer
    (engine.tokenizer keeps it): the next engine forked for it reads no tokenizer file
    (its `tokenizer` phase is 0) and encodes as the first did. Once a tokenizer file
    changes, the next fork reads it again."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    server = ForkServerProc(tmp_path / "fork.sock")
    engines: list[EngineProcess] = []
    try:
        server.wait_ready()

        def start() -> dict[str, Any]:
            e = EngineProcess(disk_flags(model), forkserver=server.sock)
            engines.append(e)
            return e.wait_ready()

        first, second = start(), start()
        assert first["tokenizer"] == "read"
        assert second["tokenizer"] == "read before the fork"
        assert second["phases"]["tokenizer"] == 0
        text = {"prompt": "Hello world. How are you today?", "max_tokens": 4, "ignore_eos": True}
        said = [_completion(e.url, text) for e in engines]
        assert said[0] == said[1] and said[0]["usage"]["prompt_tokens"] > 1
        config = model / "tokenizer_config.json"
        config.write_text(config.read_text() + "\n")  # the same settings, another file
        assert start()["tokenizer"] == "read"
    finally:
        for e in engines:
            e.stop()
        server.stop()


def _completion(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(), method="POST"
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        out: dict[str, Any] = json.loads(resp.read())
    out.pop("id", None)
    out.pop("created", None)
    return out
