"""Token-replay migration of a streamed reply: what the router keeps per stream, and how it
continues the stream on the next primary when the one answering dies or is fenced.

The router asks the engine for `return_token_ids` (vLLM's extension; engine/api.py): each
chunk then carries the ids of its tokens and the first one the prompt's ids (a completion
chunk in its choice, a chat chunk beside its choices, as vLLM sends them). After a cut
the continuation is a `/v1/completions` request of the prompt's ids followed by the ids
already sent, with `max_tokens` reduced by them and the same sampling fields. A chat
request is continued the same way, at the token level (the chat template is not rendered
again), and its chunks are reshaped into chat chunks. The client sees one stream: the
first chunk's id and `created` throughout, no token twice, none missing, the continuation's
`finish_reason`, and (chat with `stream_options.include_usage`) usage over the whole answer.
Where the continuation begins the router writes an SSE comment, `: migrated`, which clients
skip (the chaos suite counts them).

A non-streamed request with one choice and nothing its stream cannot rebuild (`collectable`:
no logprobs, echo, best_of, several prompts, tools, ...) is asked for as a stream too and
collected (`Stream.collect`): its client gets one JSON body at the end, the engine's own
non-streamed shape (supervisor/proxy/answers.py), migrated or not. Since that client has seen
nothing yet, a cut rewinds the tokens whose text the engine still held back (part of a
character, or of a stop string), and the continuation makes them again, so their text is
decoded with the tokens after them.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from supervisor.kinds.base import TOKEN_IDS, StreamShape

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# the request fields a continuation keeps: what decides which tokens come next
KEEP = (
    "model",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "best_of",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "seed",
    "stop",
    "ignore_eos",
    "skip_special_tokens",
    "user",
)
# the fields of a non-streamed request whose answer can be built from its stream (allowlist)
COLLECTABLE = frozenset(KEEP).union(
    ("prompt", "prompt_token_ids", "messages", "max_tokens", "max_completion_tokens"),
    ("stream", "logprobs"),
)
# what an engine adds to a finishing choice beyond OpenAI's fields, kept for the client
# (vLLM's `stop_reason`: the stop string or token id that ended the answer)
FINISH_EXTRA = ("stop_reason",)


class StreamCut(Exception):
    """The upstream stream ended before `data: [DONE]` (an EOF, not an error)."""


@dataclass
class Stream:
    """One streamed request under way: the request, and what its client has seen."""

    path: str  # COMPLETIONS or CHAT, as the client asked
    request: dict[str, Any]
    collect: bool = False  # a non-streamed request: its client gets one JSON body at the end
    shape: StreamShape = TOKEN_IDS  # where the engine kind's chunks carry token ids
    prompt_ids: list[int] | None = None  # from the first chunk
    emitted: list[int] = field(default_factory=list)  # token ids sent to the client
    chunk_id: str = ""
    created: int = 0
    model: str = ""
    finish_reason: str | None = None
    finish_extra: dict[str, Any] = field(default_factory=dict)  # FINISH_EXTRA, as the engine sent
    fingerprint: str | None = None  # the engine's `system_fingerprint`, if it sent one
    usage_sent: bool = False
    usage: dict[str, Any] | None = None  # the engine's usage chunk, if it sent one
    text: list[str] = field(default_factory=list)  # the text of the tokens, chunk by chunk
    held: int = 0  # the last tokens, whose chunks carried no text (the engine held it back)
    migrated: int = 0  # continuations started
    last_token_at: float = 0.0  # monotonic time of the last token chunk written
    cut_at: float = 0.0  # last_token_at of a cut not yet resumed (0: none)
    pending: bool = False  # a migration under way: it succeeds at [DONE]
    wrote: int = 0  # events written to the client
    epoch: int = 0  # of the primary answering now
    # kept warm on the next standby (supervisor/proxy/warming.py): under this key, on that engine,
    # this many tokens of prompt and answer; one warm request at a time
    warm_key: str = ""
    warmed_on: str = ""
    warmed: int = 0
    # tokens kept under warm_key, by engine@version, on every engine that kept some: a heir
    # named since (the superseded primary back as a standby) does not hide the last one
    kept_at: dict[str, int] = field(default_factory=dict)
    warming: bool = False
    over: bool = False  # ended: its past is forgotten once no warm request is under way
    kept: int = 0  # what the engine of the continuation under way said it kept (KEPT_HEADER)
    kv_key: str = ""  # its key in the engines' shared KV caches (engines.kv_adopt)

    @property
    def chat(self) -> bool:
        return self.path == CHAT

    @property
    def max_tokens(self) -> int | None:
        r = self.request
        if self.chat:
            value = r.get("max_completion_tokens") or r.get("max_tokens")
        else:
            value = r.get("max_tokens", DEFAULT_MAX_TOKENS)
        return value if isinstance(value, int) else None

    @property
    def wants_usage(self) -> bool:
        opts = self.request.get("stream_options")
        return self.chat and isinstance(opts, dict) and bool(opts.get("include_usage"))

    def first_body(self) -> bytes:
        body = {**self.request, "return_token_ids": True}
        if self.kv_key:
            body["holdfast_kv"] = self.kv_key
        if self.collect:
            body.update(stream=True, stream_options={"include_usage": True})
        return json.dumps(body).encode()

    def fresh(self) -> Stream:
        """The same request with nothing received yet (what was kept warm is stale)."""
        return Stream(
            self.path, self.request, collect=self.collect, shape=self.shape, kv_key=self.kv_key
        )

    def can_continue(self) -> bool:
        """Whether the ids needed for a continuation are known."""
        return self.prompt_ids is not None

    def left(self) -> int | None:
        """Tokens still owed to the client (None: as many as fit)."""
        m = self.max_tokens
        return None if m is None else m - len(self.emitted)

    def continuation(self, warm_key: str = "") -> bytes:
        """The `/v1/completions` body that continues this stream where it was cut (naming
        the key its past is kept warm under on that engine, if any)."""
        prompt = self.prompt_ids if self.prompt_ids is not None else []
        body = {k: self.request[k] for k in KEEP if k in self.request}
        body.update(
            prompt=[
                *prompt,
                *self.emitted,
            ],  # token ids: the reference engine and vLLM read them here
            max_tokens=self.left(),
            stream=True,
            return_token_ids=True,
        )
        if self.chat:  # as the chat reply decodes, unless the request said otherwise
            body.setdefault("skip_special_tokens", True)
        if warm_key:
            body["holdfast_warm"] = warm_key
        if self.kv_key:  # the engine goes on listing it in its ledger
            body["holdfast_kv"] = self.kv_key
        return json.dumps(body).encode()

    def rewind(self) -> None:
        """Before a collected request's continuation: forget the last tokens whose text the
        engine held back, so the continuation makes them again and decodes their text
        with what follows (nothing of them reached the client)."""
        if self.held:
            del self.emitted[-self.held :]
            self.held = 0

    # ---- reading chunks ----
    def seen(self, event: dict[str, Any]) -> None:
        """Record what one chunk going to the client carries."""
        if not self.chunk_id:
            self.chunk_id = str(event.get("id", ""))
            self.created = int(event.get("created", 0) or 0)
            self.model = str(event.get("model", ""))
        if "usage" in event and event.get("usage"):
            self.usage_sent = True
            self.usage = event["usage"]
        if isinstance(event.get("system_fingerprint"), str):
            self.fingerprint = event["system_fingerprint"]
        self.prompt_from(event)  # vLLM's chat chunk carries the prompt's ids here
        for choice in event.get("choices") or ():
            self.prompt_from(choice)  # a completion chunk's choice carries them
            ids = self.shape.token_ids(choice)
            if ids:
                self.emitted.extend(ids)
                self.last_token_at = time.monotonic()
            text = text_of(choice)
            if text:
                self.text.append(text)
            self.held = 0 if text else self.held + len(ids)
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
                self.finish_extra = extra(choice)
                self.held = 0  # the finish chunk carries what was held back

    def prompt_from(self, part: dict[str, Any]) -> None:
        """The prompt's ids from the first chunk or choice that carries them."""
        if self.prompt_ids is None:
            self.prompt_ids = self.shape.prompt_ids(part)

    def reshape(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        """A continuation's completion chunk as the client's stream carries it."""
        out: list[dict[str, Any]] = []
        for choice in event.get("choices") or ():
            text = str(choice.get("text", ""))
            ids = self.shape.token_ids(choice)
            finish = choice.get("finish_reason")
            if not self.chat:
                c = {"index": 0, "text": text, "token_ids": ids, "finish_reason": finish}
                out.append(self.envelope([{**c, **extra(choice)} if finish is not None else c]))
                continue
            if ids or text:
                delta = {"index": 0, "delta": {"content": text}, "logprobs": None}
                out.append(self.envelope([{**delta, "finish_reason": None, "token_ids": ids}]))
            if finish is not None:
                end = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish}
                out.append(self.envelope([{**end, **extra(choice)}]))
        if out and isinstance(event.get("system_fingerprint"), str):
            out[-1]["system_fingerprint"] = event["system_fingerprint"]
        return out

    def envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {
            "id": self.chunk_id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def closing(self) -> list[dict[str, Any]]:
        """What goes before `[DONE]` that the continuation did not send: a finish chunk
        when every owed token was sent but no finish_reason, and usage when asked for."""
        out: list[dict[str, Any]] = []
        if self.finish_reason is None and self.left() == 0:
            self.finish_reason = "length"
            if self.chat:
                out.append(
                    self.envelope(
                        [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}]
                    )
                )
            else:
                choice = {"index": 0, "text": "", "token_ids": [], "finish_reason": "length"}
                out.append(self.envelope([choice]))
        if self.wants_usage and not self.usage_sent and self.prompt_ids is not None:
            out.append({**self.envelope([]), "usage": self.total_usage()})
            self.usage_sent = True
        return out

    def total_usage(self) -> dict[str, Any] | None:
        """Usage over the whole answer, from the ids (the engine's own without them)."""
        if self.prompt_ids is None:
            return self.usage
        prompt, done = len(self.prompt_ids), len(self.emitted)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

    def complete(self) -> bool:
        """Whether nothing is owed: the stream may end with `[DONE]` without an upstream."""
        return self.finish_reason is not None or self.left() == 0


def plan(method: str, path: str, body: bytes, shape: StreamShape = TOKEN_IDS) -> Stream | None:
    """The `Stream` of a generation request, streamed or `collectable`, else None (relayed
    as bytes, retried only before its first byte); `shape`: the engine kind's chunks."""
    if method != "POST" or path not in (COMPLETIONS, CHAT):
        return None
    try:
        request = json.loads(body)
    except ValueError:
        return None  # the engine answers it with its 400
    if not isinstance(request, dict) or (request.get("n") or 1) != 1:
        return None
    if request.get("stream") is True:
        return Stream(path, request, shape=shape)
    if off(request.get("stream")) and collectable(request):
        return Stream(path, request, collect=True, shape=shape)
    return None


def collectable(request: dict[str, Any]) -> bool:
    """Whether a non-streamed request's answer can be built from its stream: only fields
    of COLLECTABLE, one choice, one prompt, no logprobs."""
    prompt = request.get("prompt")
    return (
        request.keys() <= COLLECTABLE
        and off(request.get("logprobs"))
        and (request.get("best_of") or 1) == 1
        and (not isinstance(prompt, list) or all(type(t) is int for t in prompt))
    )


def off(value: Any) -> bool:
    """Whether a flag is left out, null or false (not 0: the engine refuses that)."""
    return value is None or value is False


def extra(choice: dict[str, Any]) -> dict[str, Any]:
    """The FINISH_EXTRA fields a finishing choice carries."""
    return {k: choice[k] for k in FINISH_EXTRA if k in choice}


def text_of(choice: dict[str, Any]) -> str:
    """The text one chunk's choice carries: a completion's `text`, a chat `delta`'s content."""
    delta = choice.get("delta")
    text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
    return text if isinstance(text, str) else ""
