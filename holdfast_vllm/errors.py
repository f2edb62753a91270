"""One root exception for the vLLM loader plugin."""

from __future__ import annotations

from holdfast_contract.errors import HoldfastError


class PluginError(HoldfastError):
    """The holdfast load format cannot load the model as configured; the message says what
    to change (a key of --model-loader-extra-config, a daemon flag, the checkpoint)."""


class LayoutError(PluginError):
    """A pool in vLLM's layout cannot be made for this checkpoint (`cachedaemon serve
    --layout vllm`); the message names what to change."""
