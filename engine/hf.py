"""`--model-impl hf`: any Hugging Face transformers model, built from its config on meta.

Parameters are created on the meta device (buffers such as rotary frequencies are computed
for real), then attached from the daemon or loaded from disk by name. Causal LMs serve
greedy completions through HF's own forward with its KV cache; other models serve
/v1/embeddings, pooled as the checkpoint's sentence-transformers modules say
(engine.pooling; the mean over the input's tokens when it has none).
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch
from torch import nn

from cachedaemon.errors import CacheError
from cachedaemon.hf import empty_model, model_class
from engine.errors import BadRequest, ModelConfigError
from engine.job import Generation, Job, OnStep, Step
from engine.pooling import pool, read_pooling


class HFModel:
    def __init__(self, model_dir: str | Path, dtype: torch.dtype, device: torch.device) -> None:
        from transformers import AutoConfig

        self.device = device
        config = AutoConfig.from_pretrained(str(model_dir))
        try:
            _, self.kind = model_class(config)
            self.module: nn.Module = empty_model(model_dir, dtype, device)
        except CacheError as e:
            raise ModelConfigError(str(e)) from e
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.vocab_size = int(text.vocab_size)
        self.max_len = int(getattr(text, "max_position_embeddings", 2048) or 2048)
        self.pad_id = int(getattr(text, "pad_token_id", None) or 0)
        self.pooling = read_pooling(model_dir)
        eos = getattr(config, "eos_token_id", None)
        self.eos = frozenset(eos if isinstance(eos, list) else [] if eos is None else [eos])

    def tie(self) -> None:
        """Share the weights the config ties (input embeddings and LM head)."""
        tie_weights = getattr(self.module, "tie_weights", None)
        if callable(tie_weights):
            tie_weights()

    def finish(self) -> None:
        """After weights are in: tie again, in case attach replaced one side of a tie."""
        self.tie()

    def warmup(self) -> None:
        if self.kind == "generate":
            self.run(Job((0,), 1, 0, True))
        else:
            self.embed([[0]])

    @torch.inference_mode()
    def run(
        self, job: Job, on_step: OnStep | None = None, cancel: threading.Event | None = None
    ) -> Generation:
        if self.kind != "generate":
            raise BadRequest("this model serves /v1/embeddings only")
        ids = torch.tensor([job.prompt], dtype=torch.int64, device=self.device)
        past, reason = None, "length"
        steps: list[Step] = []
        while len(steps) < job.max_tokens:
            if cancel is not None and cancel.is_set():
                reason = "cancelled"
                break
            out = self.module(input_ids=ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
            token = int(torch.argmax(logp))
            top: tuple[tuple[int, float], ...] = ()
            if job.top_logprobs:
                vals, idx = torch.topk(logp, job.top_logprobs)
                top = tuple(zip(idx.tolist(), vals.tolist(), strict=True))
            steps.append(Step(token, float(logp[token]), top))
            if on_step is not None:
                on_step(steps[-1])
            if token in self.eos and not job.ignore_eos:
                reason = "stop"
                break
            ids = torch.tensor([[token]], dtype=torch.int64, device=self.device)
        return Generation(len(job.prompt), tuple(steps), reason)

    @torch.inference_mode()
    def embed(self, batch: list[list[int]]) -> list[list[float]]:
        """One forward pass over the batch, right-padded with an attention mask, pooled
        as the checkpoint's sentence-transformers modules say."""
        if self.kind != "embed":
            raise BadRequest("this model serves /v1/completions and /v1/chat/completions only")
        longest = max(map(len, batch))
        ids = torch.full((len(batch), longest), self.pad_id, dtype=torch.int64)
        mask = torch.zeros((len(batch), longest), dtype=torch.int64)
        for i, item in enumerate(batch):
            ids[i, : len(item)] = torch.tensor(item)
            mask[i, : len(item)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        hidden = self.module(input_ids=ids, attention_mask=mask).last_hidden_state
        out: list[list[float]] = pool(hidden, mask, self.pooling).tolist()
        return out

    def follow(self) -> int:
        raise ModelConfigError("--model-impl hf serves at --world-size 1 only")

    def stop_followers(self) -> None:
        return None
