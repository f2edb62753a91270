"""A small real tokenizer for generated checkpoints, built here with the `tokenizers` package.

A byte-level BPE (GPT-2's byte-to-character map) trained on a built-in English text: its
alphabet is the printable ASCII bytes plus tab and newline, so any ASCII text round-trips
(other bytes become `<unk>`); merges fill the vocabulary up to the preset's `vocab_size`
where the text has that many, and a larger vocabulary (llama-8b's 128,256) is filled up
with tokens `<|fill_N|>` that no merge makes: text never encodes to them, but every id the
model can produce decodes (to its fill token), so vLLM and any other engine that needs a
tokenizer can serve the preset. BOS is added by the post-processor
(as Llama's tokenizer does), and tokenizer_config.json carries a chat template. The same
files come out on every machine: training is deterministic for a fixed text and size.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cachedaemon.errors import CacheError

SPECIALS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]  # ids 0..5
BOS, EOS = "<s>", "</s>"

CORPUS = """\
holdfast keeps the weights of a model resident in memory across engine restarts.
When the primary dies, a standby takes over in milliseconds.
The router sends each request to the current primary and retries those that had not started.
Hello! Hello world. How are you today? I am fine, thank you. What is your name?
A cache daemon loads the checkpoint once and hands the pool to every engine as fds.
Tokens are pieces of words; a tokenizer turns text into ids and the ids back into text.
The quick brown fox jumps over the lazy dog. Once upon a time, there was a small model.
Tell me a story about the sea, the stars and the wind. Write a poem. Answer in one line.
"""

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('role ' + m['role'] + ' is not supported') }}{% endif %}"
    "<|{{ m['role'] }}|>\n{{ m['content'] | trim }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def byte_chars() -> dict[int, str]:
    """GPT-2's map of bytes to printable characters, which the ByteLevel pre-tokenizer uses."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = dict(zip(keep, map(chr, keep), strict=True)), 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def alphabet() -> list[str]:
    """The characters of tab, newline and printable ASCII, as the pre-tokenizer writes them."""
    chars = byte_chars()
    return [chars[b] for b in (9, 10, *range(32, 127))]


def write_tokenizer(out: Path, vocab_size: int, max_length: int) -> None:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json into `out`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    floor = len(SPECIALS) + len(alphabet())
    if vocab_size < floor:
        raise CacheError(f"vocab_size {vocab_size} is below the tokenizer's alphabet ({floor})")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=alphabet(),
        limit_alphabet=len(alphabet()),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer)
    if tok.get_vocab_size() < vocab_size:
        tok = _filled(tok, vocab_size)
    if tok.get_vocab_size() != vocab_size:
        raise CacheError(
            f"the tokenizer has {tok.get_vocab_size()} ids, not the preset's vocab_size {vocab_size}"
        )
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    tok.save(str(out / "tokenizer.json"))
    specials = {"bos_token": BOS, "eos_token": EOS, "unk_token": "<unk>"}
    config = {
        **specials,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_length,
        "add_bos_token": True,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2))


def _filled(tok: Any, vocab_size: int) -> Any:
    """`tok` with its BPE vocabulary filled up to `vocab_size` ids by `<|fill_N|>` tokens:
    no merge makes them, so no text encodes to them; each decodes to its own name."""
    from tokenizers import Tokenizer

    spec = json.loads(tok.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    for i in range(len(vocab), vocab_size):
        vocab[f"<|fill_{i}|>"] = i
    return Tokenizer.from_str(json.dumps(spec))
