"""Checkpoints for the vLLM tests and bench, written by transformers' save_pretrained: a
random Llama, and a Qwen2 with tied embeddings, each with a BPE tokenizer trained here (with
a chat template). Sized for vLLM's CPU attention (head size 64). Runs in any python with transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

ARCHS = ("llama", "qwen2")


def causal_lm_checkpoint(
    out: Path, arch: str, *, hidden: int = 128, layers: int = 2, seed: int = 0, context: int = 512
) -> Path:
    """save_pretrained of a random float32 `arch` (llama or qwen2-tied) and a tokenizer, with
    a context of `context` tokens."""
    import torch
    import transformers

    from tests.hf_checkpoints import CHAT_TEMPLATE, train_tokenizer

    tokenizer = train_tokenizer(add_bos_token=arch == "llama", chat_template=CHAT_TEMPLATE)
    common: dict[str, Any] = {
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": hidden // 64,
        "num_key_value_heads": 1,
        "vocab_size": 256,
        "max_position_embeddings": context,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "torch_dtype": "float32",
        "initializer_range": 0.5,  # far from uniform logits: greedy tokens vary, ties are rare
    }
    torch.manual_seed(seed)
    if arch == "llama":
        model: Any = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**common, tie_word_embeddings=True)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        raise ValueError(f"arch must be one of {ARCHS}, not {arch!r}")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


if __name__ == "__main__":
    import sys

    for a in ARCHS:
        causal_lm_checkpoint(Path(sys.argv[1]) / a, a)
