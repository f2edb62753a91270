"""The daemon with real processes: zero-copy attach, read-only, escrow, bad clients."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from cachedaemon import protocol
from cachedaemon.client import attach_state_dict
from holdfast_contract import wire
from tests.conftest import REPO, child_env


class Client:
    """tests/programs/attach_client.py in its own process."""

    def __init__(self, sock: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "programs" / "attach_client.py"), str(sock)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(),
        )
        self.hello = self.read()

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            assert self.proc.stderr is not None
            raise AssertionError(
                f"client exited {self.proc.wait()}: {self.proc.stderr.read()[-2000:]}"
            )
        return dict(json.loads(line))

    def ask(self, cmd: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> int:
        if self.proc.poll() is None:
            self.ask_nowait("exit")
        rc = self.proc.wait(20)
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if f:
                f.close()
        return rc

    def ask_nowait(self, cmd: str) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(cmd + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass


def digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


@pytest.fixture(scope="module")
def medium_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~200 MB in bf16 over 24 tensors: big enough that a copy would show in RSS."""
    path = tmp_path_factory.mktemp("models") / "medium"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    gen = torch.Generator().manual_seed(0)
    tensors = {
        f"model.layers.{i}.mlp.up_proj.weight": torch.randn(2048, 2048, generator=gen).bfloat16()
        for i in range(24)
    }
    save_file(tensors, str(path / "model.safetensors"))
    return path


def test_two_clients_map_the_pool_byte_for_byte_without_copying(
    medium_model: Path, tmp_path: Path, start_daemon: Any
) -> None:
    start_daemon(medium_model, tmp_path / "run")
    sock = tmp_path / "run" / "daemon-0.sock"
    expected = digest(load_file(medium_model / "model.safetensors"))
    pool_kb = sum(t.nbytes for t in load_file(medium_model / "model.safetensors").values()) // 1024
    clients = [Client(sock), Client(sock)]
    try:
        for c in clients:
            assert c.hello["attached"] == 24
            # RSS from /proc/self/status VmRSS before and after attach_state_dict: the pool
            # is mapped, not read, so attaching adds far less than the pool's size
            assert c.hello["rss_after_kb"] - c.hello["rss_before_kb"] < pool_kb // 20
            assert c.ask("digest")["digest"] == expected
    finally:
        for c in clients:
            c.close()
    status, _ = protocol.call(str(sock), protocol.StatusRequest())
    assert isinstance(status, protocol.StatusReply) and status.clients_attached == 2


def test_a_client_cannot_change_the_shared_weights(
    tiny_model: Path, tmp_path: Path, start_daemon: Any
) -> None:
    start_daemon(tiny_model, tmp_path / "run")
    sock = tmp_path / "run" / "daemon-0.sock"
    before = digest(attach_state_dict(sock))
    writer = Client(sock)
    writer.ask_nowait("write")
    rc = writer.close()
    assert rc == -signal.SIGSEGV, "a write to the read-only mapping must fault in the writer"
    assert digest(attach_state_dict(sock)) == before
    # nor through a writable mapping of the fd it was given: the memfd is sealed
    import mmap

    reply, fds = protocol.call(str(sock), protocol.AttachRequest(), max_fds=8)
    try:
        with pytest.raises(PermissionError):
            mmap.mmap(fds[0], mmap.PAGESIZE, flags=mmap.MAP_SHARED, prot=mmap.PROT_WRITE)
        with pytest.raises(PermissionError):
            os.pwrite(fds[0], b"x", 0)
    finally:
        wire.close_fds(fds)


def test_daemon_death_keeps_clients_and_the_keeper_restores_the_pool(
    tiny_model: Path, tmp_path: Path, start_daemon: Any
) -> None:
    from cachedaemon.keeper import Keeper

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    run = tmp_path / "run"
    with Keeper(run / "keeper.sock") as keeper:
        first = start_daemon(model, run, "--keeper", str(keeper.socket_path))
        sock = run / "daemon-0.sock"
        expected = digest(load_file(model / "model.safetensors"))
        client = Client(sock)
        try:
            os.kill(first.proc.pid, signal.SIGKILL)
            first.proc.wait(10)
            assert client.ask("digest")["digest"] == expected  # still mapped, still right

            second = start_daemon(model, run, "--keeper", str(keeper.socket_path))
            assert '"adopted": true' in second.log
            assert '"checkpoint_bytes_read": 0' in second.log
            # reclaiming, verifying and serving a CPU pool never loads torch: fast restarts
            assert "libtorch" not in Path(f"/proc/{second.proc.pid}/maps").read_text()
            assert digest(attach_state_dict(sock)) == expected
            assert client.ask("digest")["digest"] == expected

            # Zero every tensor byte of the checkpoint (headers intact): the files are
            # another checkpoint now, and a restart loads them instead of the pool in escrow
            second.stop()
            _zero_tensor_data(model / "model.safetensors")
            third = start_daemon(model, run, "--keeper", str(keeper.socket_path))
            assert '"adopted": false' in third.log
            assert digest(attach_state_dict(sock)) != expected
            assert client.ask("digest")["digest"] == expected  # the old mapping is untouched
        finally:
            client.close()
        assert keeper.pools()[0].reclaims == 1


def test_a_spare_takes_over_when_the_serving_daemon_dies(
    tiny_model: Path, tmp_path: Path, start_daemon: Any
) -> None:
    from cachedaemon.keeper import Keeper

    run = tmp_path / "run"
    with Keeper(run / "keeper.sock") as keeper:
        keeper_arg = ("--keeper", str(keeper.socket_path))
        first = start_daemon(tiny_model, run, *keeper_arg)
        spare = start_daemon(tiny_model, run, *keeper_arg, "--spare", wait=False)
        spare.wait_for('"event": "spare waiting"')
        expected = digest(attach_state_dict(run / "daemon-0.sock"))
        os.kill(first.proc.pid, signal.SIGKILL)
        spare.wait_serving(30)
        assert '"adopted": true' in spare.log and '"checkpoint_bytes_read": 0' in spare.log
        assert json.loads((run / "daemon-0.ready").read_text())["pid"] == spare.proc.pid
        assert digest(attach_state_dict(run / "daemon-0.sock")) == expected


def _zero_tensor_data(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    raw[8 + n :] = bytes(len(raw) - 8 - n)
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("verify", ["before", "background"])
def test_keeper_pool_with_bad_checksums_is_reloaded_from_disk(
    tiny_model: Path, tmp_path: Path, start_daemon: Any, verify: str
) -> None:
    import msgspec

    from cachedaemon.keeper import Keeper

    run = tmp_path / "run"
    with Keeper(run / "keeper.sock") as keeper:
        first = start_daemon(tiny_model, run, "--keeper", str(keeper.socket_path))
        reply, fds = protocol.call(
            str(keeper.socket_path),
            protocol.Reclaim(json.loads((run / "daemon-0.ready").read_text())["fingerprint"]),
            max_fds=8,
        )
        assert isinstance(reply, protocol.Reclaimed)
        first.stop()
        bad = msgspec.structs.replace(
            reply.manifest,
            tensors=tuple(
                msgspec.structs.replace(t, checksum="00000000") for t in reply.manifest.tensors
            ),
        )
        protocol.call(str(keeper.socket_path), protocol.Deposit(bad), fds)
        wire.close_fds(fds)
        keeper_arg = ("--keeper", str(keeper.socket_path), "--verify", verify)
        if verify == "background":
            # serves at once, finds the mismatch, withdraws the pool and exits 3 ...
            hasty = start_daemon(tiny_model, run, *keeper_arg)
            assert '"adopted": true' in hasty.log
            assert hasty.proc.wait(60) == 3
            hasty.exited.wait(5)
            assert "failed checksums while serving; withdrawing it" in hasty.log
            assert keeper.pools() == []
            # ... so that the next start loads from disk
            second = start_daemon(tiny_model, run, *keeper_arg)
            assert 'checkpoint_bytes_read": 0' not in second.log
        else:
            second = start_daemon(tiny_model, run, *keeper_arg)
            assert "keeper pool failed checksums; reloading from disk" in second.log
        assert '"adopted": false' in second.log
        expected = digest(load_file(tiny_model / "model.safetensors"))
        assert digest(attach_state_dict(run / "daemon-0.sock")) == expected


def test_bad_clients_do_not_stop_the_daemon(
    tiny_model: Path, tmp_path: Path, start_daemon: Any
) -> None:
    start_daemon(tiny_model, tmp_path / "run", "--read-timeout", "0.5")
    path = str(tmp_path / "run" / "daemon-0.sock")
    silent = socket.socket(socket.AF_UNIX)
    silent.connect(path)  # says nothing, holds its connection
    frames = [b"\x00\x00\x00\x05garbage", b"\x00\x00\x01\x00abc", struct.pack(">I", 1 << 30)]
    for frame in frames:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(path)
            s.sendall(frame)
            s.shutdown(socket.SHUT_WR)
            reply, _ = protocol.recv(s)
            assert isinstance(reply, protocol.ErrorReply) and "bad frame" in reply.message
    reply, _ = protocol.call(path, protocol.Ping())
    assert isinstance(reply, protocol.Pong)
    assert len(attach_state_dict(path)) == 21
    silent.settimeout(5)
    assert protocol.recv(silent)[0] == protocol.ErrorReply(
        "bad frame: timed out waiting for a frame"
    )
    silent.close()


@pytest.mark.skipif(os.getuid() != 0, reason="switching uid needs root")
def test_a_peer_of_another_uid_is_refused(
    tiny_model: Path, tmp_path: Path, start_daemon: Any
) -> None:
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="hf-uid-", dir="/tmp"))
    run = base / "run"
    start_daemon(tiny_model, run)
    # open the file modes so only SO_PEERCRED stands between another user and the pool
    for p in (base, run):
        os.chmod(p, 0o755)
    os.chmod(run / "daemon-0.sock", 0o777)
    code = (
        "import os, sys\n"
        "from cachedaemon import protocol\n"
        "os.setgid(65534); os.setuid(65534)\n"
        "reply, fds = protocol.call(sys.argv[1], protocol.AttachRequest(), max_fds=8)\n"
        "print(type(reply).__name__, len(fds), getattr(reply, 'message', ''))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(run / "daemon-0.sock")],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=60,
        cwd="/",
    )
    shutil.rmtree(base, ignore_errors=True)
    assert out.stdout.startswith("ErrorReply 0 peer uid 65534 is not this server's uid 0"), (
        out.stderr
    )


def test_runtime_dir_errors(tiny_model: Path, tmp_path: Path, start_daemon: Any) -> None:
    bad = start_daemon(tiny_model, Path("/proc/holdfast-run"), wait=False)
    assert bad.proc.wait(60) == 2
    bad.exited.wait(5)
    assert "pass --runtime-dir a writable dir" in bad.log

    run = tmp_path / "run"
    run.mkdir()
    (run / "daemon-0.ready").write_text(json.dumps({"pid": 2**22 - 1, "start_time": 1}))
    (run / "daemon-0.sock").write_text("stale")
    start_daemon(tiny_model, run)  # stale files of a dead owner are replaced
    second = start_daemon(tiny_model, run, wait=False)
    assert second.proc.wait(60) == 2
    second.exited.wait(5)
    assert "already served by live pid" in second.log


def test_tp2_daemons_serve_shards_that_reassemble(
    tiny_model: Path, tmp_path: Path, start_daemon: Any
) -> None:
    run = tmp_path / "run"
    daemons = [
        start_daemon(tiny_model, run, "--tp-size", "2", "--tp-rank", str(rank), wait=False)
        for rank in (0, 1)
    ]
    for d in daemons:
        d.wait_serving()
    full = load_file(tiny_model / "model.safetensors")
    shards = [attach_state_dict(run / f"daemon-{r}.sock") for r in (0, 1)]
    name = "model.layers.1.self_attn.o_proj.weight"
    assert torch.equal(torch.cat([shards[0][name], shards[1][name]], 1), full[name])
    name = "model.embed_tokens.weight"
    assert torch.equal(torch.cat([shards[0][name], shards[1][name]], 0), full[name])
