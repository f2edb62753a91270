"""The model pools' memory that a crew holds, from the kernel's own accounts.

A pool of the memfd backend is a set of memfd chunks (`holdfast-pool`): its memory is
freed when no process holds one open (the daemons, the keeper inside the supervisor)
and none maps it (the engines). So the bytes of the distinct chunks that the crew's
processes hold open (`/proc/<pid>/fd`) or map (`/proc/<pid>/maps`) are what the pools
take now: one pool's worth while one version serves, two while an update builds the
next beside it, one again once the old pool is freed. The cuda-vmm backend's pools are
not seen here (the figure is 0 there).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path

from chaos.procs import ProcRef

CHUNK = "/memfd:holdfast-pool"  # what /proc shows of a pool chunk (cachedaemon/backends/memfd.py)


def pool_bytes(procs: Iterable[ProcRef]) -> int:
    """Bytes of the distinct pool chunks the processes hold open or map."""
    chunks: dict[int, int] = {}  # inode: size
    for ref in (p for p in procs if p.alive()):  # (never a recycled pid's)
        for inode, size in [*_held(ref.pid), *_mapped(ref.pid)]:
            chunks[inode] = max(size, chunks.get(inode, 0))
    return sum(chunks.values())


def _held(pid: int) -> list[tuple[int, int]]:
    """(inode, size) of each pool chunk `pid` holds open."""
    out = []
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            path = f"/proc/{pid}/fd/{fd}"
            with contextlib.suppress(OSError):
                if os.readlink(path).startswith(CHUNK):
                    st = os.stat(path)
                    out.append((st.st_ino, st.st_size))
    return out


def _mapped(pid: int) -> list[tuple[int, int]]:
    """(inode, mapped bytes) of each pool chunk mapping of `pid`: a chunk is mapped whole."""
    try:
        text = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith(CHUNK):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            out.append((int(fields[4]), end - start))
    return out
