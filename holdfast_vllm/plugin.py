"""The `vllm.general_plugins` entry point: registers the `holdfast` load format.

vLLM calls `register` in its API process, the engine core and every worker before it
builds a model loader, so `--load-format holdfast` is known wherever it is needed.
"""

from __future__ import annotations

from holdfast_vllm import LOAD_FORMAT


def register() -> None:
    from vllm.model_executor.model_loader import register_model_loader

    from holdfast_vllm.loader import HoldfastModelLoader

    register_model_loader(LOAD_FORMAT)(HoldfastModelLoader)
