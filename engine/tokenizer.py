"""The checkpoint's tokenizer (tokenizer.json via the `tokenizers` package), when it has one."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class Tokenizer:
    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self._tok: Any = HFTokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=False))


def load_tokenizer(model_dir: str | Path) -> Tokenizer | None:
    """None when the dir has no tokenizer.json or `tokenizers` is not installed."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        return Tokenizer(path)
    except ImportError:
        return None
