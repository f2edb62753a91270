"""The weight cache on a real GPU, through real daemon, keeper and client processes."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import child_env

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("cuda.bindings")

from cachedaemon import quant  # noqa: E402
from cachedaemon.client import attach_state_dict  # noqa: E402
from cachedaemon.loader import LoadOptions, load_state_dict  # noqa: E402

# Attaches, then runs matvecs over every 2-D weight in a loop on a thread, counting outputs
# that differ from the first one. Answers "report" on stdin with one JSON line.
LOOP_CLIENT = r"""
import hashlib, json, sys, threading, torch
from cachedaemon.client import attach_state_dict
sd = attach_state_dict(sys.argv[1])
ws = [sd[n] for n in sorted(sd) if sd[n].dim() == 2 and sd[n].is_floating_point()]
vs = [torch.linspace(-1, 1, w.shape[1], device=w.device, dtype=w.dtype) for w in ws]
def forward():
    out = torch.cat([w @ v for w, v in zip(ws, vs)]).view(torch.uint8).cpu()
    return hashlib.sha256(out.numpy().tobytes()).hexdigest()
ref = forward()
state = {"count": 0, "mismatches": 0}
def loop():
    while True:
        state["mismatches"] += forward() != ref
        state["count"] += 1
threading.Thread(target=loop, daemon=True).start()
print(json.dumps({"ref": ref}), flush=True)
for line in sys.stdin:
    print(json.dumps(state), flush=True)
"""


def raw_digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(
            a.contiguous().view(-1).view(torch.uint8).cpu(),
            b.contiguous().view(-1).view(torch.uint8).cpu(),
        )
    )


class KeeperProc:
    """A standalone `cachedaemon keeper` process; `ready` is set when it logs that it serves."""

    def __init__(self, sock: Path) -> None:
        self.sock = sock
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cachedaemon",
                "--log-format",
                "json",
                "keeper",
                "--socket",
                str(sock),
            ],
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(),
        )
        self.ready = threading.Event()
        self.lines: list[str] = []
        self._pumper = threading.Thread(target=self._pump, daemon=True)
        self._pumper.start()

    def _pump(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            if "keeper serving" in line:
                self.ready.set()
        self.proc.stderr.close()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self._pumper.join(10)


@pytest.fixture
def keeper(tmp_path: Path) -> Any:
    k = KeeperProc(tmp_path / "run" / "keeper.sock")
    assert k.ready.wait(30), "".join(k.lines)
    yield k
    k.stop()


def _zero_tensor_data(model: Path) -> None:
    for path in model.glob("*.safetensors"):
        raw = bytearray(path.read_bytes())
        (n,) = struct.unpack("<Q", raw[:8])
        raw[8 + n :] = bytes(len(raw) - 8 - n)
        path.write_bytes(bytes(raw))


def _gpu_pids() -> set[int] | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {int(x) for x in out.split() if x.strip().isdigit()}


def test_attach_equals_a_direct_gpu_load(
    tiny_model: Path, tmp_path: Path, start_daemon: Any
) -> None:
    start_daemon(tiny_model, tmp_path / "run", "--device", "cuda:0")
    attached = attach_state_dict(tmp_path / "run" / "daemon-0.sock")
    direct = load_state_dict(tiny_model, LoadOptions(device="cuda:0"))
    assert sorted(attached) == sorted(direct)
    for name, t in attached.items():
        assert t.device == torch.device("cuda:0")
        assert bytes_equal(t, direct[name]), name


def test_fp8_block_on_gpu_equals_cpu_bit_for_bit(
    tiny_model: Path, tmp_path: Path, start_daemon: Any
) -> None:
    gen = torch.Generator().manual_seed(3)
    for shape in ((300, 520), (128, 128), (7, 1000)):
        w = (torch.randn(shape, generator=gen) * 0.05).to(torch.bfloat16)
        cpu_q, cpu_s = quant.fp8_block_quantize(w)
        gpu_q, gpu_s = quant.fp8_block_quantize(w.to("cuda:0"))
        assert bytes_equal(cpu_q, gpu_q) and bytes_equal(cpu_s, gpu_s), shape
    start_daemon(tiny_model, tmp_path / "run", "--device", "cuda:0", "--quantization", "fp8-block")
    attached = attach_state_dict(tmp_path / "run" / "daemon-0.sock")
    on_cpu = load_state_dict(tiny_model, LoadOptions(quantization="fp8-block"))
    assert any(t.dtype == torch.float8_e4m3fn for t in attached.values())
    assert sorted(attached) == sorted(on_cpu)
    for name, t in attached.items():
        assert bytes_equal(t, on_cpu[name]), name


@pytest.mark.parametrize("hash_batch", [1, 1 << 30], ids=["hashed-one-by-one", "hashed-at-once"])
@pytest.mark.parametrize("transformed", [True, False], ids=["fp8-tp2", "as-the-file-holds"])
def test_parallel_gpu_fill_builds_the_same_pool(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch, hash_batch: int, transformed: bool
) -> None:
    """The parallel load, its digest and checksums hashed beside the copies (a batch per
    tensor, or all at the end), builds the pool the serial load does: the same manifest
    (every checksum, the files' digests), the same bytes. Tensors copied as the file holds
    them are digested on the GPU; transformed ones by their readers."""
    from cachedaemon import cuda_load, pool
    from cachedaemon.backends.cuda_vmm import CudaVmmBackend

    monkeypatch.setattr(cuda_load, "HASH_BATCH", hash_batch)
    backend = CudaVmmBackend("cuda:0")
    opts = (
        LoadOptions(tp_size=2, tp_rank=1, quantization="fp8-block", device="cuda:0")
        if transformed
        else LoadOptions(device="cuda:0")
    )
    monkeypatch.setattr(pool, "_filler", lambda _backend: pool._fill)
    serial, _ = pool.build_pool(tiny_model, opts, backend, "fp")
    monkeypatch.setattr(pool, "_filler", lambda _backend: cuda_load.fill_parallel)
    parallel, read = pool.build_pool(tiny_model, opts, backend, "fp")
    assert read == sum(
        f.stat().st_size for f in tiny_model.glob("*.safetensors")
    ) - 8 - _header_len(tiny_model)
    assert parallel.manifest == serial.manifest
    a, b = serial.tensors(), parallel.tensors()
    assert all(bytes_equal(a[n], b[n]) for n in a)
    assert not parallel.bad_tensors(backend)
    serial.close()
    parallel.close()


def _header_len(model: Path) -> int:
    with (model / "model.safetensors").open("rb") as f:
        return int(struct.unpack("<Q", f.read(8))[0])


def test_client_write_faults_and_the_pool_is_unchanged(
    tiny_model: Path, tmp_path: Path, start_daemon: Any
) -> None:
    start_daemon(tiny_model, tmp_path / "run", "--device", "cuda:0")
    sock = tmp_path / "run" / "daemon-0.sock"
    before = raw_digest(attach_state_dict(sock))
    code = (
        "import sys, torch\nfrom cachedaemon.client import attach_state_dict\n"
        "sd = attach_state_dict(sys.argv[1])\nprint('ATTACHED', flush=True)\n"
        "sd[sorted(sd)[0]].add_(1); torch.cuda.synchronize(); print('WROTE', flush=True)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(sock)],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(),
    )
    assert "ATTACHED" in proc.stdout, proc.stderr
    assert "WROTE" not in proc.stdout
    assert proc.returncode != 0
    assert raw_digest(attach_state_dict(sock)) == before


def test_kill9_daemon_mid_forward_then_reclaim_from_keeper(
    tiny_model: Path, tmp_path: Path, start_daemon: Any, keeper: KeeperProc
) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    run = tmp_path / "run"
    sock = run / "daemon-0.sock"
    first = start_daemon(model, run, "--device", "cuda:0", "--keeper", str(keeper.sock))
    expected = raw_digest(load_state_dict(model, LoadOptions(device="cuda:0")))
    client = subprocess.Popen(
        [sys.executable, "-c", LOOP_CLIENT, str(sock)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    assert client.stdin is not None and client.stdout is not None

    def report() -> dict[str, int]:
        client.stdin.write("report\n")  # type: ignore[union-attr]
        client.stdin.flush()  # type: ignore[union-attr]
        return dict(json.loads(client.stdout.readline()))  # type: ignore[union-attr]

    try:
        assert "ref" in json.loads(client.stdout.readline())
        _assert_keeper_has_no_cuda(keeper.proc.pid, first.proc.pid)
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait(10)
        at_kill = report()["count"]
        second = start_daemon(model, run, "--device", "cuda:0", "--keeper", str(keeper.sock))
        assert '"adopted": true' in second.log
        assert '"checkpoint_bytes_read": 0' in second.log
        assert raw_digest(attach_state_dict(sock)) == expected
        after = report()
        assert after["count"] > at_kill and after["mismatches"] == 0
        # the checkpoint changed in place (every tensor byte zeroed): another checkpoint,
        # which a restart loads from its files rather than taking the pool in escrow
        second.stop()
        _zero_tensor_data(model)
        third = start_daemon(model, run, "--device", "cuda:0", "--keeper", str(keeper.sock))
        assert '"adopted": false' in third.log
        assert raw_digest(attach_state_dict(sock)) != expected
        assert report()["mismatches"] == 0  # the client's mapping of the old pool is untouched
    finally:
        client.kill()
        client.wait(10)
        client.stdin.close()
        client.stdout.close()


def _assert_keeper_has_no_cuda(keeper_pid: int, daemon_pid: int) -> None:
    maps = Path(f"/proc/{keeper_pid}/maps").read_text()
    assert "libcuda" not in maps and "libtorch" not in maps, "the keeper loaded CUDA or torch"
    pids = _gpu_pids()
    if pids is not None and daemon_pid in pids:  # nvidia-smi sees processes on this machine
        assert keeper_pid not in pids
