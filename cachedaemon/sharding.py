"""Tensor-parallel sharding plans: which dim of which tensor is split across ranks.

A plan is a list of (regex, dim) rules, first match wins; dim None means replicated. User
rules come before the default plan for the Llama / Qwen2 / Mistral / Mixtral family.
"""

from __future__ import annotations

import hashlib
import re
from functools import lru_cache

from cachedaemon.errors import ShardingError

Rule = tuple[str, int | None]

DEFAULT_RULES: tuple[Rule, ...] = (
    # column-parallel: output features split
    (r"(^|\.)(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$", 0),
    (r"(^|\.)experts\.\d+\.(w1|w3)\.weight$", 0),
    # row-parallel: input features split
    (r"(^|\.)(o_proj|down_proj)\.weight$", 1),
    (r"(^|\.)experts\.\d+\.w2\.weight$", 1),
    # vocab-parallel
    (r"(^|\.)embed_tokens\.weight$", 0),
    (r"^lm_head\.weight$", 0),
)


def parse_rule(text: str) -> Rule:
    """`REGEX=DIM` or `REGEX=replicate`, as given to --shard-rule."""
    pattern, sep, dim = text.rpartition("=")
    if not sep or not pattern:
        raise ShardingError(f"--shard-rule {text!r}: expected REGEX=DIM or REGEX=replicate")
    try:
        re.compile(pattern)
    except re.error as exc:
        raise ShardingError(f"--shard-rule {text!r}: bad regex: {exc}") from exc
    if dim == "replicate":
        return (pattern, None)
    if not dim.isdigit():
        raise ShardingError(f"--shard-rule {text!r}: DIM must be a number or 'replicate'")
    return (pattern, int(dim))


@lru_cache(maxsize=64)
def _compiled(rules: tuple[Rule, ...]) -> tuple[tuple[re.Pattern[str], int | None], ...]:
    return tuple((re.compile(p), d) for p, d in (*rules, *DEFAULT_RULES))


def shard_dim(name: str, rules: tuple[Rule, ...] = ()) -> int | None:
    for pattern, dim in _compiled(rules):
        if pattern.search(name):
            return dim
    return None


def shard_shape(
    name: str, shape: tuple[int, ...], dim: int | None, tp_size: int
) -> tuple[int, ...]:
    if dim is None or tp_size == 1:
        return shape
    if dim >= len(shape):
        raise ShardingError(f"tensor {name!r} of shape {list(shape)} has no dim {dim} to split")
    if shape[dim] % tp_size:
        raise ShardingError(
            f"tensor {name!r}: dim {dim} of size {shape[dim]} is not divisible by "
            f"--tp-size {tp_size}; choose a tp size that divides it"
        )
    return (*shape[:dim], shape[dim] // tp_size, *shape[dim + 1 :])


def plan_hash(rules: tuple[Rule, ...]) -> str:
    text = repr((*rules, *DEFAULT_RULES))
    return hashlib.sha256(text.encode()).hexdigest()[:16]
