"""OpenAI chat completions: the request, the checkpoint's chat template, and the reply shapes.

The template is rendered with jinja2 the way transformers' `apply_chat_template` renders it
(sandboxed, trim_blocks + lstrip_blocks, loop controls, its `tojson`, `raise_exception` and
`strftime_now`, the special tokens as variables, `add_generation_prompt=True`), and the
result is encoded without adding special tokens, as transformers does.
"""

from __future__ import annotations

from typing import Any

import msgspec

from engine import api
from engine.chat_template import compile_template
from engine.errors import BadRequest
from engine.tokenizer import Tokenizer

ROLES = ("system", "developer", "user", "assistant", "tool")


class TextPart(msgspec.Struct, frozen=True):
    type: str
    text: str | None = None


class Message(msgspec.Struct, frozen=True):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None


class StreamOptions(msgspec.Struct, frozen=True):
    include_usage: bool = False


class ChatRequest(api.Sampling, frozen=True):
    messages: list[Message] = []
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    logprobs: bool | None = None
    ignore_eos: bool = False
    tools: list[Any] | None = None
    return_token_ids: bool = False
    response_format: dict[str, Any] | None = None
    holdfast_kv: str = ""  # the stream's key in a shared KV cache's ledger (engine/kvshare.py)


def render(template: str, messages: list[dict[str, Any]], specials: dict[str, str]) -> str:
    """The prompt text, as `apply_chat_template(messages, add_generation_prompt=True,
    tokenize=False)` gives it."""
    import jinja2

    try:
        text: str = compile_template(template).render(
            messages=messages, add_generation_prompt=True, **specials
        )
    except jinja2.exceptions.TemplateError as e:
        raise BadRequest(f"the checkpoint's chat template refused the messages: {e}") from None
    return text


def _content(message: Message, index: int) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    texts = []
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise api.InvalidField(
                f"messages[{index}].content has a {part.type!r} part; this engine takes text only",
                f"messages[{index}].content",
            )
        texts.append(part.text)
    return "\n".join(texts)


def message_dicts(messages: list[Message]) -> list[dict[str, Any]]:
    if not messages:
        raise api.InvalidField("`messages` is empty; send at least one message", "messages")
    out = []
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise api.InvalidField(
                f"messages[{i}].role {m.role!r} is not one of {', '.join(ROLES)}",
                f"messages[{i}].role",
            )
        d: dict[str, Any] = {"role": m.role, "content": _content(m, i)}
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out


def _unsupported(req: ChatRequest) -> None:
    for field, value in (("tools", req.tools), ("logprobs", req.logprobs or None)):
        if value:
            raise api.InvalidField(f"`{field}` is not supported by this engine", field)
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise api.InvalidField(
            "`response_format` other than text is not supported by this engine", "response_format"
        )


def chat_prompt(
    req: ChatRequest, tok: Tokenizer | None, limits: api.Limits
) -> tuple[list[int], int]:
    """The prompt's token ids and max_tokens, after every check a chat request can fail."""
    api.check_greedy(req)
    _unsupported(req)
    messages = message_dicts(req.messages)
    if tok is None or tok.chat_template is None:
        raise BadRequest(
            "this checkpoint has no chat template (no `chat_template` in tokenizer_config.json, "
            "no chat_template.jinja); use /v1/completions with a prompt you format yourself"
        )
    text = render(tok.chat_template, messages, tok.special_tokens)
    ids = tok.encode(text, add_special_tokens=False)
    api.check_ids(ids, limits, "messages")
    max_tokens = req.max_completion_tokens or req.max_tokens
    if max_tokens is None:  # OpenAI's default: as many as fit
        max_tokens = api.fitting(len(ids), limits)
    api.check_budget(len(ids), max_tokens, limits, "max_completion_tokens")
    return ids, max_tokens


def models_body(model_id: str) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"id": model_id, "object": "model", "created": 0, "owned_by": "holdfast"}],
    }
