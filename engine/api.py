"""The HTTP request bodies this engine accepts, and their validation (400s that name fields).

An OpenAI-compatible subset: unknown fields are ignored so stock clients work. Decoding is
always greedy: sampling fields set to anything but their greedy value are refused by name.
`prompt_token_ids`, `ignore_eos` and `token_ids` in replies are extensions, and so is
`return_token_ids` (vLLM's name): streamed chunks then carry the token ids of each delta and
the first one the prompt's (`prompt_token_ids`), so a router can continue a cut stream at
the token level (supervisor/proxy/migration.py). `max_tokens: null` means as many as fit.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec

from engine.errors import BadRequest
from engine.job import TOP_LOGPROBS_MAX
from engine.tokenizer import Tokenizer

T = TypeVar("T")
MAX_STOPS = 4


class InvalidField(BadRequest):
    """A 400 about one request field, named in the OpenAI error's `param`."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class Sampling(msgspec.Struct, frozen=True):
    """OpenAI's sampling fields: accepted only at the values that mean greedy decoding."""

    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    best_of: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    top_k: int | None = None
    min_p: float | None = None


GREEDY: dict[str, tuple[object, ...]] = {
    "temperature": (0,),
    "top_p": (1,),
    "n": (1,),
    "best_of": (1,),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "repetition_penalty": (1,),
    "top_k": (0, -1, 1),
    "min_p": (0,),
}


def check_greedy(req: Sampling) -> None:
    bad = [
        f"{field}={value!r} (greedy: {allowed[0]})"
        for field, allowed in GREEDY.items()
        if (value := getattr(req, field)) is not None and value not in allowed
    ]
    if req.logit_bias:
        bad.append("logit_bias (greedy: none)")
    if bad:
        raise InvalidField(
            "this engine decodes greedily only; drop or set to greedy: " + ", ".join(bad),
            bad[0].partition("=")[0].partition(" ")[0],
        )


class CompletionRequest(Sampling, frozen=True):
    prompt: str | list[int] | None = None
    prompt_token_ids: list[int] | None = None
    max_tokens: int | None = 16  # None: as many as fit, as for chat
    stream: bool = False
    logprobs: int | None = None
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    return_token_ids: bool = False
    skip_special_tokens: bool = False
    holdfast_warm: str = ""  # a prefix kept under this key may be continued (WarmRequest)
    holdfast_kv: str = ""  # the stream's key in a shared KV cache's ledger (engine/kvshare.py)


class WarmRequest(msgspec.Struct, frozen=True):
    """`POST /holdfast/warm`: prefill `prompt` and keep it under `key` for a continuation
    (`holdfast_warm` in a completion request); with `forget`, give back what `key` keeps."""

    key: str
    prompt: list[int] = []
    forget: bool = False


class EmbeddingRequest(msgspec.Struct, frozen=True):
    input: str | list[str | int | list[int]]


class Limits(msgspec.Struct, frozen=True):
    vocab_size: int
    max_model_len: int
    max_tokens_cap: int


def decode_body(body: bytes, kind: type[T]) -> T:
    if not body.strip():
        raise BadRequest("empty request body; send a JSON object")
    try:
        out: T = msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        raise BadRequest(f"invalid request: {e}") from None
    except msgspec.DecodeError as e:
        raise BadRequest(f"malformed JSON: {e}") from None
    return out


def tokens(
    text_or_ids: str | list[int], tok: Tokenizer | None, field: str, max_length: int | None = None
) -> list[int]:
    if isinstance(text_or_ids, list):
        return text_or_ids
    if tok is None:
        raise BadRequest(
            f"`{field}` is text but this checkpoint has no tokenizer.json; "
            "send token ids in `prompt_token_ids` instead"
        )
    return tok.encode(text_or_ids, max_length=max_length)


def check_ids(ids: list[int], limits: Limits, field: str) -> None:
    if not ids:
        raise BadRequest(f"`{field}` is empty; send at least one token")
    bad = [t for t in ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise BadRequest(
            f"`{field}` has token ids outside the vocabulary [0, {limits.vocab_size}): {bad[:5]}"
        )


def stops(stop: str | list[str] | None) -> tuple[str, ...]:
    """The `stop` strings of a request (at most 4, none empty)."""
    out = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(out) > MAX_STOPS or any(not s for s in out):
        raise InvalidField(f"`stop` takes 1..{MAX_STOPS} non-empty strings", "stop")
    return out


def check_budget(prompt_len: int, max_tokens: int, limits: Limits, field: str) -> None:
    if not 1 <= max_tokens <= limits.max_tokens_cap:
        raise InvalidField(
            f"`{field}` {max_tokens} must be in 1..{limits.max_tokens_cap} "
            "(the engine's --max-tokens-cap)",
            field,
        )
    if prompt_len + max_tokens > limits.max_model_len:
        raise InvalidField(
            f"prompt ({prompt_len} tokens) + `{field}` ({max_tokens}) exceeds "
            f"the context length {limits.max_model_len}; shorten the prompt or "
            f"lower {field}",
            field,
        )


def fitting(prompt_len: int, limits: Limits) -> int:
    """max_tokens when a request leaves it out (null): as many as fit."""
    return max(1, min(limits.max_tokens_cap, limits.max_model_len - prompt_len))


def completion_prompt(
    req: CompletionRequest, tok: Tokenizer | None, limits: Limits
) -> tuple[list[int], int]:
    """The prompt's token ids and max_tokens, after every check a request can fail."""
    check_greedy(req)
    stops(req.stop)
    given = [
        (f, v)
        for f, v in (("prompt", req.prompt), ("prompt_token_ids", req.prompt_token_ids))
        if v is not None
    ]
    if len(given) != 1:
        raise BadRequest("send exactly one of `prompt` (text or token ids) or `prompt_token_ids`")
    field, raw = given[0]
    ids = tokens(raw, tok, field)
    check_ids(ids, limits, field)
    max_tokens = req.max_tokens if req.max_tokens is not None else fitting(len(ids), limits)
    check_budget(len(ids), max_tokens, limits, "max_tokens")
    if req.logprobs is not None and not 0 <= req.logprobs <= TOP_LOGPROBS_MAX:
        raise BadRequest(f"`logprobs` must be in 0..{TOP_LOGPROBS_MAX}")
    return ids, max_tokens


def embedding_inputs(
    req: EmbeddingRequest, tok: Tokenizer | None, limits: Limits
) -> list[list[int]]:
    raw = req.input
    items: list[str | list[int]]
    if isinstance(raw, str):
        items = [raw]
    elif all(isinstance(x, int) for x in raw):
        items = [[x for x in raw if isinstance(x, int)]]
    elif any(isinstance(x, int) for x in raw):
        raise BadRequest("`input` mixes token ids with texts or lists; send one kind")
    else:
        items = [x for x in raw if not isinstance(x, int)]
    if not items:
        raise BadRequest("`input` is empty; send text, token ids, or a list of either")
    cap = tok.max_length if tok is not None else None  # sentence-transformers' max_seq_length
    out = [tokens(item, tok, "input", cap) for item in items]
    for ids in out:
        check_ids(ids, limits, "input")
        if len(ids) > limits.max_model_len:
            raise BadRequest(
                f"an `input` of {len(ids)} tokens exceeds the context length {limits.max_model_len}"
            )
    return out
