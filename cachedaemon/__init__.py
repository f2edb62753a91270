"""holdfast weight cache: load a checkpoint once, keep it in one pool, hand it out as fds.

The torch-facing names (`attach_model`, `attach_state_dict`) are imported lazily so that
torch-free parts (the wire protocol, the keeper, the config) import without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cachedaemon.version import __version__

__all__ = ["CacheConfig", "attach_model", "attach_state_dict", "__version__"]

if TYPE_CHECKING:
    from cachedaemon.client import attach_model, attach_state_dict
    from cachedaemon.config import CacheConfig


def __getattr__(name: str) -> Any:
    if name in ("attach_model", "attach_state_dict"):
        from cachedaemon import client

        return getattr(client, name)
    if name == "CacheConfig":
        from cachedaemon.config import CacheConfig

        return CacheConfig
    raise AttributeError(f"module 'cachedaemon' has no attribute {name!r}")
