"""A model version: the short, stable name of what a pool holds, which every answer
carries (X-Holdfast-Model-Version, `system_fingerprint`). It is derived from the content
digest the cache daemon takes of the checkpoint as it loads it (cachedaemon/digest.py)
and the form the weights are held in (dtype, quantization), so the same bytes held the
same way are the same version on every node and after every restart, and a fine-tune of
the same shapes is another. `Source` is where an engine of one version gets its weights."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch-free, but imported only where they are used
    from cachedaemon.protocol import StatusReply

LENGTH = 12  # hex digits of a version


def version_of(status: StatusReply) -> str:
    """The version of the pool a daemon's status describes: its checkpoint's content
    digest, else (a pool loaded without one) its fingerprint, with dtype and quantization."""
    c = status.config
    if status.files:
        files = sorted(status.files, key=lambda f: f.name)
        content = "\n".join(f"{f.name} {f.size} {f.blake3}" for f in files)
    else:
        content = status.fingerprint
    form = f"{c.dtype} {c.quantization}"
    return "v" + hashlib.sha256(f"{content}\n{form}".encode()).hexdigest()[: LENGTH - 1]


@dataclass(frozen=True)
class Source:
    """Where an engine of one model version gets its weights: the checkpoint dir (for its
    config and tokenizer), the daemons' sockets (one per rank) and the pool's form."""

    version: str
    model_dir: str
    daemons: tuple[str, ...]
    dtype: str
    quantization: str
    generation: int = 1
