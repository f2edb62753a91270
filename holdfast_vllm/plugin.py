"""The `vllm.general_plugins` entry point: registers the `holdfast` load format.

vLLM calls `register` in its API process, the engine core and every worker before it
builds a model loader, so `--load-format holdfast` is known wherever it is needed.

With `HOLDFAST_VLLM_FORK=1` in the environment it also has the API server fork its
EngineCore instead of spawning it (`core_fork.fork_engine_core`).
"""

from __future__ import annotations

import os

from holdfast_vllm import LOAD_FORMAT
from holdfast_vllm.core_fork import FORK_ENV, fork_engine_core


def register() -> None:
    from vllm.model_executor.model_loader import register_model_loader

    from holdfast_vllm import refusal
    from holdfast_vllm.loader import HoldfastModelLoader

    refusal.arm()  # a refusal in the EngineCore is printed last, by this process
    register_model_loader(LOAD_FORMAT)(HoldfastModelLoader)
    if os.environ.get(FORK_ENV) == "1":
        fork_engine_core()
