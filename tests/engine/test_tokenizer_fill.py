"""The built-in tokenizer of a generated checkpoint whose vocabulary the built-in text
cannot fill (llama-8b's 128,256 ids): every id decodes, no text encodes to a fill token,
and the same files come out twice."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachedaemon.tokenizer_gen import write_tokenizer
from engine.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")

VOCAB = 128_256  # llama-8b's


def test_a_large_vocabulary_is_filled_so_every_id_decodes(tmp_path: Path) -> None:
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    write_tokenizer(tmp_path / "a", VOCAB, 8192)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "a")
    assert len(hf) == VOCAB
    last = hf.convert_ids_to_tokens(VOCAB - 1)
    assert last == f"<|fill_{VOCAB - 1}|>"
    text = "Tell me a story about <|fill_5000|> and the sea. " * 3
    ids = hf(text).input_ids
    assert max(ids) < 1000  # fill tokens are never made from text, even their own names
    assert hf.decode(ids, skip_special_tokens=True) == text
    ours = load_tokenizer(tmp_path / "a")
    assert ours.encode(text) == ids
    write_tokenizer(tmp_path / "b", VOCAB, 8192)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
