"""The cuda-vmm backend on a real GPU: fds shared between real processes, read-only maps,
memory that outlives its creator, and the on-GPU checksum."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("cuda.bindings")

from cachedaemon.backends.cuda_vmm import CudaVmmBackend  # noqa: E402
from cachedaemon.cuda_checksum import ROW, gpu_checksum, gpu_checksums  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20

# A child that maps fd FD (SIZE bytes) read-only and reports what it sees, then runs ACTION.
CLIENT = """
import hashlib, json, sys, torch
from cachedaemon.backends.cuda_vmm import CudaVmmBackend
from cachedaemon.cuda_checksum import gpu_checksum
m = CudaVmmBackend("cuda:0").open(FD, SIZE)
t = m.tensor
print(json.dumps({"checksum": gpu_checksum(t),
                  "sha256": hashlib.sha256(t.cpu().numpy().tobytes()).hexdigest(),
                  "device": str(t.device)}), flush=True)
ACTION
"""


def _run(
    code: str, fds: tuple[int, ...] = (), timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        pass_fds=fds,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _client(fd: int, size: int, action: str = "") -> subprocess.CompletedProcess[str]:
    code = CLIENT.replace("FD", str(fd)).replace("SIZE", str(size)).replace("ACTION", action)
    return _run(code, (fd,))


@pytest.fixture(scope="module")
def backend() -> CudaVmmBackend:
    return CudaVmmBackend("cuda:0")


@pytest.fixture(scope="module")
def sealed(backend: CudaVmmBackend):  # type: ignore[no-untyped-def]
    chunk = backend.create(64 * MiB + 5)
    gen = torch.Generator(device="cuda:0").manual_seed(7)
    chunk.tensor.copy_(
        torch.randint(0, 256, (chunk.size,), dtype=torch.uint8, device="cuda:0", generator=gen)
    )
    chunk.seal()
    yield chunk
    chunk.close()


def test_sizes_round_to_granularity(backend: CudaVmmBackend) -> None:
    g = backend.granularity
    assert g >= 64 * 1024 and g & (g - 1) == 0
    assert backend.round_size(1) == g
    assert backend.round_size(g + 1) == 2 * g


def test_client_sees_the_owners_bytes(sealed) -> None:  # type: ignore[no-untyped-def]
    import hashlib

    proc = _client(sealed.fd, sealed.size)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.splitlines()[0])
    assert seen["device"] == "cuda:0"
    assert seen["checksum"] == gpu_checksum(sealed.tensor)
    assert seen["sha256"] == hashlib.sha256(sealed.tensor.cpu().numpy().tobytes()).hexdigest()


def test_client_write_faults_and_pool_is_unchanged(sealed) -> None:  # type: ignore[no-untyped-def]
    before = gpu_checksum(sealed.tensor)
    proc = _client(sealed.fd, sealed.size, "t.fill_(7); torch.cuda.synchronize(); print('WROTE')")
    assert "WROTE" not in proc.stdout
    assert proc.returncode != 0
    assert "illegal" in proc.stderr.lower() or "error" in proc.stderr.lower(), proc.stderr
    assert gpu_checksum(sealed.tensor) == before


def test_owner_mapping_is_read_only_after_seal() -> None:
    code = """
    import torch
    from cachedaemon.backends.cuda_vmm import CudaVmmBackend
    c = CudaVmmBackend("cuda:0").create(1 << 20)
    c.tensor.fill_(1); torch.cuda.synchronize(); print("FILLED", flush=True)
    c.seal()
    c.tensor.fill_(2); torch.cuda.synchronize(); print("WROTE", flush=True)
    """
    proc = _run(code)
    assert "FILLED" in proc.stdout, proc.stderr
    assert "WROTE" not in proc.stdout
    assert proc.returncode != 0


def test_memory_outlives_its_creator() -> None:
    """The creator exits; a process that only holds the fd (no CUDA) keeps the memory."""
    here, there = socket.socketpair()
    code = f"""
    import socket, torch
    from cachedaemon.backends.cuda_vmm import CudaVmmBackend
    from cachedaemon.cuda_checksum import gpu_checksum
    c = CudaVmmBackend("cuda:0").create(32 << 20)
    c.tensor.copy_(torch.arange(c.size, device="cuda:0").mul_(31).remainder_(251).to(torch.uint8))
    c.seal()
    s = socket.socket(fileno={there.fileno()})
    socket.send_fds(s, [gpu_checksum(c.tensor).encode()], [c.fd])
    """
    owner = _run(code, (there.fileno(),))
    there.close()
    assert owner.returncode == 0, owner.stderr
    msg, fds, _, _ = socket.recv_fds(here, 64, 1)
    here.close()
    try:
        proc = _client(fds[0], 32 * MiB)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout.splitlines()[0])["checksum"] == msg.decode()
    finally:
        os.close(fds[0])


def test_memory_is_freed_when_last_fd_and_view_go(backend: CudaVmmBackend) -> None:
    torch.cuda.synchronize()
    free0, _ = torch.cuda.mem_get_info()
    chunk = backend.create(1 << 30)
    view = chunk.tensor[:16]
    assert torch.cuda.mem_get_info()[0] <= free0 - (1 << 30)
    chunk.close()
    assert view.sum().item() >= 0  # still mapped while a view lives
    del view
    import gc

    gc.collect()
    assert torch.cuda.mem_get_info()[0] >= free0 - (64 << 20)


def test_checksum_is_exact_and_sensitive() -> None:
    data = torch.randint(0, 256, (3 * 4096 * 40 + 77,), dtype=torch.uint8)
    gpu = data.to("cuda:0")
    assert gpu_checksum(gpu) == gpu_checksum(data)  # exact integer math on both
    for index in (0, 4096 * 17 + 3, data.numel() - 1):
        flipped = gpu.clone()
        flipped[index] ^= 1
        assert gpu_checksum(flipped) != gpu_checksum(gpu)
    swapped = gpu.clone()
    swapped[[0, 4096]] = gpu[[4096, 0]]
    if gpu[0] != gpu[4096]:
        assert gpu_checksum(swapped) != gpu_checksum(gpu)


def test_batched_checksums_equal_one_by_one(backend: CudaVmmBackend) -> None:
    """Regions of one chunk are checksummed together; each equals its checksum alone."""
    chunk = backend.create(8 * MiB)
    chunk.tensor.view(torch.int32).random_()
    sizes = [1, 255, 256, 257, 17 * ROW, 17 * ROW + 3, 3 * MiB + 5, 100_000]
    regions, offset = [], 0
    for n in sizes:
        regions.append(chunk.tensor[offset : offset + n])
        offset = -(-(offset + n) // ROW) * ROW
    together = gpu_checksums(regions)
    assert together == [gpu_checksum(r.clone()) for r in regions]
    assert len(set(together)) == len(sizes)
    chunk.close()
