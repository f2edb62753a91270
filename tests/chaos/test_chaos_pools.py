"""The pool memory a crew holds, read from /proc of real processes: a chunk held open or
mapped counts once however many processes share it, and it is gone once none does."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from chaos.pools import pool_bytes
from chaos.procs import ProcRef

KIB = 1024
# holds two pool chunks (64 and 32 KiB) open and maps the first, and one memfd of
# another name; prints each chunk's fd number, then waits for stdin to close
HOLDER = """
import mmap, os, sys
maps, fds = [], []
for name, size in (("holdfast-pool", 64 << 10), ("holdfast-pool", 32 << 10), ("other", 16 << 10)):
    fd = os.memfd_create(name)
    os.ftruncate(fd, size)
    fds.append(fd)
maps.append(mmap.mmap(fds[0], 64 << 10, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ))
print(fds[0], fds[1], flush=True)
sys.stdin.read()
"""
# maps a chunk another process holds (opened through /proc/<pid>/fd/<n>), then closes
# its fd: libc's mmap, since Python's mmap object keeps a duplicate of the fd
MAPPER = """
import ctypes, ctypes.util, mmap, os, sys
libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [
    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long
]
fd = os.open(sys.argv[1], os.O_RDONLY)
libc.mmap(None, int(sys.argv[2]), mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
os.close(fd)
print("mapped", flush=True)
sys.stdin.read()
"""


@contextmanager
def _process(code: str, *args: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A python process running `code`, and its first line of output (it has set up)."""
    with subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        try:
            yield proc, proc.stdout.readline().strip()
        finally:
            proc.stdin.close()  # it ends
            proc.wait(timeout=30)


def test_a_chunk_shared_by_processes_counts_once_and_frees_with_the_last() -> None:
    with _process(HOLDER) as (holder, said):
        first, _ = said.split()
        held = ProcRef.of(holder.pid)
        assert held is not None
        assert pool_bytes([held]) == 96 * KIB  # both chunks; the other memfd is no pool
        chunk = f"/proc/{holder.pid}/fd/{first}"
        with _process(MAPPER, chunk, str(64 * KIB)) as (mapper, ready):
            assert ready == "mapped"
            mapped = ProcRef.of(mapper.pid)
            assert mapped is not None
            assert pool_bytes([mapped]) == 64 * KIB  # mapped only, no fd
            assert pool_bytes([held, mapped]) == 96 * KIB  # the shared chunk once
            holder.stdin.close()  # type: ignore[union-attr]
            holder.wait(timeout=30)
            assert pool_bytes([held, mapped]) == 64 * KIB  # the mapping keeps it
        assert pool_bytes([held, mapped]) == 0
