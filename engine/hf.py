"""`--model-impl hf`: any Hugging Face transformers model, built from its config on meta.

Parameters are created on the meta device (buffers such as rotary frequencies are computed
for real), then attached from the daemon or loaded from disk by name. Causal LMs serve
greedy completions through HF's own forward with its KV cache; other models serve
/v1/embeddings as the mean of the last hidden state over the input's tokens.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.errors import BadRequest, ModelConfigError
from engine.runner import Generation, Job, OnStep, Step


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Every nn.Parameter registered inside lands on meta; buffers stay real."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:  # a tied (shared) one is already meta
            param = nn.Parameter(param.to("meta"), requires_grad=False)
        original(module, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def _model_class(config: Any) -> tuple[Any, str]:
    import transformers

    archs = list(getattr(config, "architectures", None) or [])
    for arch in archs:
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls, "generate" if arch.endswith("ForCausalLM") else "embed"
    if archs:
        raise ModelConfigError(
            f"config.json architectures={archs} are not in transformers "
            f"{transformers.__version__}; upgrade transformers"
        )
    return transformers.AutoModel, "embed"


class HFModel:
    def __init__(self, model_dir: str | Path, dtype: torch.dtype, device: torch.device) -> None:
        from transformers import AutoConfig

        self.device = device
        config = AutoConfig.from_pretrained(str(model_dir))
        cls, self.kind = _model_class(config)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with params_on_meta(), torch.device(device):
                self.module: nn.Module = (
                    cls.from_config(config) if hasattr(cls, "from_config") else cls(config)
                )
        finally:
            torch.set_default_dtype(previous)
        self.module.eval()
        self.tie()  # tied weights share one meta tensor, so one checkpoint entry fills both
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.vocab_size = int(text.vocab_size)
        self.max_len = int(getattr(text, "max_position_embeddings", 2048) or 2048)
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
        if self.kind != "embed":
            raise BadRequest("this model serves /v1/completions only")
        out = []
        for ids in batch:
            x = torch.tensor([ids], dtype=torch.int64, device=self.device)
            hidden = self.module(input_ids=x).last_hidden_state[0]
            out.append(hidden.float().mean(dim=0).tolist())
        return out

    def follow(self) -> int:
        raise ModelConfigError("--model-impl hf serves at --world-size 1 only")

    def stop_followers(self) -> None:
        return None
