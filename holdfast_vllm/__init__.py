"""holdfast for vLLM: a model loader (`--load-format holdfast`) that attaches the weights a
cache daemon holds instead of reading the checkpoint from disk.

    python -m vllm.entrypoints.openai.api_server --model /models/llama \
        --load-format holdfast \
        --model-loader-extra-config '{"sockets": ["/run/holdfast/daemon-0.sock"]}'

The entry point (group `vllm.general_plugins`) is `holdfast_vllm.plugin:register`; vLLM
calls it in the API process, the engine core and every worker. Only `loader` imports vLLM.
"""

from __future__ import annotations

__all__ = ["LOAD_FORMAT"]

LOAD_FORMAT = "holdfast"
