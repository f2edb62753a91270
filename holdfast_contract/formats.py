"""The weight formats every side names alike: a pool's dtypes and its post-load transforms.

The policy's schema (`supervisor.policy.ModelSpec`), the daemon's flags and identity
(`cachedaemon.config`) and the engine's flags (`engine.config`) all take their allowed
values from here, so a value one side accepts is never refused by another.
"""

from __future__ import annotations

from typing import Literal, get_args

Dtype = Literal["bfloat16", "float16", "float32"]
Quantization = Literal["none", "fp8-block"]  # fp8-block: 128x128 float8_e4m3fn + fp32 scales

DTYPES: tuple[str, ...] = get_args(Dtype)
QUANTIZATIONS: tuple[str, ...] = get_args(Quantization)


# A checkpoint `make-checkpoint` wrote says so in this file, written last, with the
# generation of what it writes (config, weights, tokenizer): a cached one of an older
# generation, or one cut short, is made again rather than served.
GENERATED_MARK = "holdfast-generated.json"
GENERATION = 3  # 2: the tiny preset has a tokenizer and a chat template; 3: llama-8b too
