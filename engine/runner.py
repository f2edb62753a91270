"""Greedy generation over one model, in lockstep across tensor-parallel ranks.

Rank 0 owns the requests: for each one it broadcasts a header (op, prompt length,
max_tokens, ignore_eos) and the prompt ids, then every step's next token, so the other
ranks run exactly the steps rank 0 runs. Ranks other than 0 sit in `follow()`.
A request whose `cancel` event is set (its client left) ends at the next step:
rank 0 broadcasts `CANCELLED` in place of a token, so every rank stops at the same step.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import msgspec
import structlog
import torch
import torch.distributed as dist

from engine.errors import BadRequest
from engine.kvcache import KVCache
from engine.model import LlamaForCausalLM

log = structlog.get_logger("engine.runner")
OP_GENERATE, OP_STOP = 1, 2
TOP_LOGPROBS_MAX = 5
CANCELLED = -1  # broadcast instead of a token: the request ends here on every rank


class Step(msgspec.Struct, frozen=True):
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


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


OnStep = Callable[[Step], None]


class Runner:
    kind = "generate"

    def __init__(self, model: LlamaForCausalLM, device: torch.device) -> None:
        self.model, self.device = model, device
        self.tp = model.tp
        self.eos = frozenset(model.args.eos_token_ids)

    def warmup(self) -> Generation:
        """One forward pass on every rank together (no broadcast: all ranks call it)."""
        return self._generate(Job((0,), 1, 0, True), None, None)

    def embed(self, batch: list[list[int]]) -> list[list[float]]:
        raise BadRequest("this model serves /v1/completions only")

    # ---- rank 0 ----
    def run(
        self, job: Job, on_step: OnStep | None = None, cancel: threading.Event | None = None
    ) -> Generation:
        """Generate for one request (rank 0); the other ranks follow."""
        if self.tp.size == 1:
            return self._generate(job, on_step, cancel)
        try:
            self._bcast([OP_GENERATE, len(job.prompt), job.max_tokens, int(job.ignore_eos)])
            self._bcast(list(job.prompt))
            return self._generate(job, on_step, cancel)
        except RuntimeError as e:  # a rank is gone: this group can never compute again
            log.critical("tensor-parallel group broken; exiting", error=str(e))
            os._exit(3)

    def stop_followers(self) -> None:
        if self.tp.size > 1:
            self._bcast([OP_STOP, 0, 0, 0])

    # ---- ranks > 0 ----
    def follow(self) -> int:
        """Run rank 0's requests until it says stop (0) or is gone (3): the exit status."""
        try:
            while True:
                op, n, max_tokens, ignore_eos = self._bcast([0, 0, 0, 0])
                if op == OP_STOP:
                    return 0
                prompt = tuple(self._bcast([0] * n))
                self._generate(Job(prompt, max_tokens, 0, bool(ignore_eos)), None, None)
        except RuntimeError as e:
            log.critical("rank 0 is gone; exiting", error=str(e))
            return 3

    # ---- all ranks ----
    @torch.inference_mode()
    def _generate(
        self, job: Job, on_step: OnStep | None, cancel: threading.Event | None
    ) -> Generation:
        a = self.model.args
        cache = KVCache(
            a.num_hidden_layers,
            a.num_key_value_heads // self.tp.size,
            a.head_dim,
            len(job.prompt) + job.max_tokens,
            self.model.dtype,
            self.device,
        )
        ids = torch.tensor(job.prompt, dtype=torch.int64, device=self.device)
        steps: list[Step] = []
        reason = "length"
        while len(steps) < job.max_tokens:
            step = self._pick(self.model(ids, cache), job.top_logprobs, cancel)
            if step is None:
                reason = "cancelled"
                break
            steps.append(step)
            if on_step is not None:
                on_step(step)
            if step.token in self.eos and not job.ignore_eos:
                reason = "stop"
                break
            ids = torch.tensor([step.token], dtype=torch.int64, device=self.device)
        return Generation(len(job.prompt), tuple(steps), reason)

    def _pick(
        self, logits: torch.Tensor, top_k: int, cancel: threading.Event | None
    ) -> Step | None:
        """The greedy token, as rank 0 broadcasts it; None once rank 0 says CANCELLED."""
        mine = CANCELLED if cancel is not None and cancel.is_set() else int(torch.argmax(logits))
        token = int(self._bcast([mine])[0])
        if token == CANCELLED:
            return None
        logp = torch.log_softmax(logits, dim=-1)
        top: tuple[tuple[int, float], ...] = ()
        if top_k:
            vals, idx = torch.topk(logp, top_k)
            top = tuple(zip(idx.tolist(), vals.tolist(), strict=True))
        return Step(token, float(logp[token]), top)

    def _bcast(self, values: list[int]) -> list[int]:
        if self.tp.size == 1:
            return values
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.broadcast(t, src=0)
        return [int(v) for v in t.tolist()]
