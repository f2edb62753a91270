"""What a generation request is and what it gives back, shared by every model kind."""

from __future__ import annotations

from collections.abc import Callable

import msgspec

TOP_LOGPROBS_MAX = 5


class Step(msgspec.Struct, frozen=True):
    """One generated token, with its logprob and, when asked, the top alternatives."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    # a continuation's first step only: the prompt positions a kept past spared its
    # prefill (engine/scheduler.py), told to the router in KEPT_HEADER
    kept: int = 0


class Generation(msgspec.Struct, frozen=True):
    prompt_tokens: int
    steps: tuple[Step, ...]
    finish_reason: str  # "stop" (an EOS token) | "length" | "cancelled" (the client left)

    @property
    def tokens(self) -> list[int]:
        return [s.token for s in self.steps]


class Job(msgspec.Struct, frozen=True):
    prompt: tuple[int, ...]
    max_tokens: int
    top_logprobs: int = 0
    ignore_eos: bool = False
    warm_key: str = ""  # a kept prefix this request may continue (engine.scheduler)
    kv_key: str = ""  # its stream's key in a shared KV cache's ledger (engine.kvshare)


OnStep = Callable[[Step], None]


class Stats(msgspec.Struct, frozen=True):
    """What the model thread is doing now, for /metrics and heartbeats."""

    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_free: int
    max_batch: int
    step_ms: float  # the last step's wall time
    steps: int
    kept_prefixes: int = 0  # streams' pasts kept warm (engine.scheduler)
    kv_blocks_kept: int = 0  # the blocks they hold (part of kv_blocks_used)
    reused_tokens: int = 0  # prompt tokens not computed again: a kept prefix held them
