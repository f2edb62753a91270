"""The checkpoint's tokenizer, giving the ids `transformers.AutoTokenizer` gives for the dir.

Read with the `tokenizers` package (no transformers import on the serving path), then set up
the way transformers sets up a fast tokenizer from the same files:

- padding and truncation stored in tokenizer.json are switched off: one input is encoded
  exactly, never padded to a fixed length nor cut (callers that want a limit ask for it);
- BOS/EOS come from tokenizer.json's post-processor, as in transformers 5 (which ignores
  `add_bos_token` / `add_eos_token` in tokenizer_config.json for a tokenizer.json);
- special tokens named in tokenizer_config.json / special_tokens_map.json but missing from
  tokenizer.json are added as special tokens;
- decode keeps special tokens and applies `clean_up_tokenization_spaces` as configured
  (never to BPE models, like transformers).

The chat template (tokenizer_config.json `chat_template` or chat_template.jinja) is kept
here and rendered by engine.chat.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.chat_template import compile_template
from engine.errors import ModelConfigError

SPECIAL_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
CLEANUPS = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file, or {} when absent; a file that does not parse names itself."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelConfigError(f"{path}: not valid JSON ({e}); fix or remove the file") from e
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(model_dir: Path, config: dict[str, Any]) -> str | None:
    """The template transformers would use, checked to compile (the error names its file)."""
    source = model_dir / "chat_template.jinja"
    if source.is_file():
        raw: Any = source.read_text()
    else:
        source = model_dir / "tokenizer_config.json"
        raw = config.get("chat_template")
    if isinstance(raw, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
        raw = named.get("default")
    if not isinstance(raw, str):
        return None
    import jinja2

    try:
        compile_template(raw)
    except jinja2.TemplateSyntaxError as e:
        raise ModelConfigError(
            f"{source}: the chat template does not compile (line {e.lineno}: {e.message})"
        ) from e
    return raw


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        from tokenizers import AddedToken
        from tokenizers import Tokenizer as HFTokenizer

        self.model_dir = Path(model_dir)
        path = self.model_dir / "tokenizer.json"
        try:
            self._tok: Any = HFTokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers package raises bare Exceptions
            raise ModelConfigError(
                f"{path}: not a tokenizer file the `tokenizers` package can read ({e}); "
                "fix or remove it"
            ) from e
        self._tok.no_padding()
        self._tok.no_truncation()
        config = {
            **read_json(self.model_dir / "special_tokens_map.json"),
            **read_json(self.model_dir / "tokenizer_config.json"),
        }
        self.special_tokens: dict[str, str] = {
            k: t for k in SPECIAL_KEYS if (t := _token_text(config.get(k))) is not None
        }
        missing = [t for t in self.special_tokens.values() if self._tok.token_to_id(t) is None]
        if missing:
            self._tok.add_special_tokens([AddedToken(t, special=True) for t in missing])
        self.chat_template = _chat_template(self.model_dir, config)
        self._clean_up = bool(config.get("clean_up_tokenization_spaces", False)) and (
            type(self._tok.model).__name__ != "BPE"
        )
        self.max_length = self._max_length(config)

    def _max_length(self, config: dict[str, Any]) -> int | None:
        """sentence-transformers' limit for embedding inputs: max_seq_length, capped by
        the tokenizer's model_max_length; None when the checkpoint sets none."""
        st = read_json(self.model_dir / "sentence_bert_config.json").get("max_seq_length")
        if not isinstance(st, int):
            return None
        cap = config.get("model_max_length")
        return min(st, cap) if isinstance(cap, int) else st

    def token_id(self, token: str) -> int:
        found = self._tok.token_to_id(token)
        if found is None:
            raise ModelConfigError(f"{self.model_dir}: token {token!r} is not in the vocabulary")
        return int(found)

    def encode(
        self, text: str, *, add_special_tokens: bool = True, max_length: int | None = None
    ) -> list[int]:
        """transformers' `tokenizer(text).input_ids`; with max_length, truncated to it
        (special tokens kept, as `truncation=True, max_length=...` does)."""
        if max_length is None:
            return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)
        self._tok.enable_truncation(max_length)
        try:
            return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)
        finally:
            self._tok.no_truncation()

    def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str:
        text = str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))
        if self._clean_up:
            for before, after in CLEANUPS:
                text = text.replace(before, after)
        return text


# every file a Tokenizer reads: a kept one is used again only while none of them changed
FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "sentence_bert_config.json",
)
_kept: dict[Path, tuple[tuple[tuple[int, int, int] | None, ...], Tokenizer]] = {}


def _files_now(model_dir: Path) -> tuple[tuple[int, int, int] | None, ...]:
    out: list[tuple[int, int, int] | None] = []
    for name in FILES:
        try:
            st = (model_dir / name).stat()
        except OSError:
            out.append(None)
        else:
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


def load_tokenizer(model_dir: str | Path, *, keep: bool = False) -> Tokenizer | None:
    """None when the dir has no tokenizer.json or `tokenizers` is not installed; a
    tokenizer file that does not parse is a ModelConfigError naming it.

    One read earlier with `keep` (the fork server's, before it forks: engine.forkserver)
    is used again while none of the dir's tokenizer files changed (inode, size, mtime):
    llama-8b's 128k-token tokenizer.json takes 0.1 s to read."""
    path = Path(model_dir).resolve()
    if not (path / "tokenizer.json").is_file():
        return None
    files = _files_now(path)
    kept = _kept.get(path)
    if kept is not None and kept[0] == files:
        return kept[1]
    try:
        tok = Tokenizer(model_dir)
    except ImportError:
        return None
    if keep:
        _kept[path] = (files, tok)
    return tok


def read_before(tok: Tokenizer | None) -> bool:
    """Whether `tok` was read before this process asked for it (kept: load_tokenizer)."""
    return tok is not None and any(t is tok for _, t in _kept.values())
