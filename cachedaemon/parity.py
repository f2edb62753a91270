"""`cachedaemon parity`: the same checkpoint loaded from disk and attached, compared."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

import cachedaemon.protocol as protocol
from cachedaemon.client import attach_state_dict
from cachedaemon.config import LoadOptions
from cachedaemon.loader import load_state_dict


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().data).hexdigest()[
        :16
    ]


def compare(disk: dict[str, torch.Tensor], pool: dict[str, torch.Tensor]) -> list[str]:
    """One line per difference; empty when the two agree in every respect."""
    diffs = [f"only on disk: {n}" for n in sorted(disk.keys() - pool.keys())]
    diffs += [f"only in pool: {n}" for n in sorted(pool.keys() - disk.keys())]
    for name in sorted(disk.keys() & pool.keys()):
        a, b = disk[name], pool[name]
        for what, x, y in (
            ("shape", tuple(a.shape), tuple(b.shape)),
            ("dtype", a.dtype, b.dtype),
            ("stride", a.stride(), b.stride()),
        ):
            if x != y:
                diffs.append(f"{name}: {what} {x} on disk, {y} in pool")
        if a.shape == b.shape and a.dtype == b.dtype and _digest(a) != _digest(b):
            diffs.append(f"{name}: bytes differ")
    return diffs


def report(model_dir: Path, socket_path: str) -> int:
    reply, _ = protocol.call(socket_path, protocol.StatusRequest())
    if not isinstance(reply, protocol.StatusReply):
        print(f"parity: {socket_path} gave no status: {reply!r}")
        return 2
    pool = attach_state_dict(socket_path)
    disk = load_state_dict(model_dir, LoadOptions.of(reply.config))
    diffs = compare(disk, pool)
    for line in diffs:
        print(line)
    print(f"parity: {len(disk)} tensors on disk, {len(pool)} in pool, {len(diffs)} differences")
    return 1 if diffs else 0
