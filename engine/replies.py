"""What one generation sends back: its text as it grows, `stop` strings, OpenAI's shapes.

A `Reply` is fed each token as the model makes it. It decodes the ids so far, holds back
text that could still become a stop string (or an unfinished UTF-8 character), and marks
itself `stopped` once a stop string appears: the caller then cancels the generation, and
the text ends just before the stop string, with finish_reason "stop".
`CompletionReply` shapes /v1/completions, `ChatReply` /v1/chat/completions.
With `prompt_ids` set (the request's `return_token_ids`), every streamed token's chunk
carries its id in the choice's `token_ids` (a chat chunk goes out even when its text is
held back) and the first chunk the prompt's ids in `prompt_token_ids`: a completion's in
its choice, a chat's beside its choices, where vLLM puts them.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from engine.job import Generation
from engine.tokenizer import Tokenizer


class Reply:
    object_name = chunk_object = "text_completion"
    prefix = "cmpl-"
    skip_special = False  # chat replies leave out special tokens (EOS, role markers)

    def __init__(self, model: str, tok: Tokenizer | None, stop: tuple[str, ...] = ()) -> None:
        self.model, self.tok, self.stop = model, tok, stop
        self.rid = self.prefix + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.ids: list[int] = []
        self.text = ""  # what the client may see: before any stop string
        self.sent = 0  # characters of `text` already streamed
        self.stopped = False
        self.prompt_ids: list[int] | None = None  # sent in the first chunk when set

    def first_ids(self) -> dict[str, Any]:
        """The prompt's ids, once: what the first streamed chunk adds (in its choice, or
        beside it)."""
        if self.prompt_ids is None:
            return {}
        ids, self.prompt_ids = self.prompt_ids, []
        return {"prompt_token_ids": ids} if ids else {}

    def feed(self, token: int) -> str:
        """Take the next token; the text that became final with it (maybe "")."""
        if self.stopped:
            return ""
        self.ids.append(token)
        if self.tok is None:
            return ""
        full = self.tok.decode(self.ids, skip_special_tokens=self.skip_special)
        cut = min((i for s in self.stop if (i := full.find(s)) >= 0), default=None)
        if cut is not None:
            self.stopped = True
            self.text = full[:cut]
        else:
            self.text = full
            full = full[: len(full) - self._held(full)]
        piece = full[self.sent :] if cut is None else self.text[self.sent :]
        self.sent += len(piece)
        return piece

    def _held(self, text: str) -> int:
        """How many trailing characters may still change: a partial stop string or an
        unfinished UTF-8 character (decoded as U+FFFD)."""
        held = len(text) - len(text.rstrip("\ufffd"))
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    held = max(held, n)
                    break
        return held

    def finish(self, gen: Generation) -> str:
        """After the model is done: take what was not fed; the finish reason."""
        rest = [s.token for s in gen.steps[len(self.ids) :]]
        if self.stop and self.tok is not None:  # token by token, to find the first stop
            for token in rest:
                if self.stopped:
                    break
                self.feed(token)
        elif not self.stopped:
            self.ids.extend(rest)
            self.text = (
                self.tok.decode(self.ids, skip_special_tokens=self.skip_special)
                if self.tok is not None
                else ""
            )
        return "stop" if self.stopped else gen.finish_reason

    def rest(self) -> str:
        """Text held back while streaming that is final now."""
        piece = self.text[self.sent :]
        self.sent = len(self.text)
        return piece

    def usage(self, gen: Generation) -> dict[str, int]:
        n = len(self.ids)
        return {
            "prompt_tokens": gen.prompt_tokens,
            "completion_tokens": n,
            "total_tokens": gen.prompt_tokens + n,
        }

    def envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        return {
            "id": self.rid,
            "object": self.chunk_object if chunk else self.object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    # Overridden per endpoint.
    def start(self) -> list[dict[str, Any]]:
        return []

    def chunk(self, piece: str, token: int | None) -> list[dict[str, Any]]:
        raise NotImplementedError

    def end(self, gen: Generation, with_usage: bool) -> list[dict[str, Any]]:
        raise NotImplementedError

    def body(self, gen: Generation) -> dict[str, Any]:
        raise NotImplementedError


class CompletionReply(Reply):
    def __init__(
        self,
        model: str,
        tok: Tokenizer | None,
        stop: tuple[str, ...],
        with_logprobs: bool,
        skip_special: bool = False,
    ) -> None:
        super().__init__(model, tok, stop)
        self.with_logprobs = with_logprobs
        self.skip_special = skip_special

    def _choice(self, text: str, ids: list[int], finish: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "token_ids": ids, "finish_reason": finish}

    def chunk(self, piece: str, token: int | None) -> list[dict[str, Any]]:
        choice = self._choice(piece, [] if token is None else [token], None)
        return [self.envelope([{**choice, **self.first_ids()}], chunk=True)]

    def end(self, gen: Generation, with_usage: bool = False) -> list[dict[str, Any]]:
        reason = self.finish(gen)
        return [self.envelope([self._choice(self.rest(), [], reason)], chunk=True)]

    def body(self, gen: Generation) -> dict[str, Any]:
        reason = self.finish(gen)
        choice = self._choice(self.text, list(self.ids), reason)
        steps = gen.steps[: len(self.ids)]
        choice["logprobs"] = (
            {
                "tokens": [str(s.token) for s in steps],
                "token_logprobs": [s.logprob for s in steps],
                "top_logprobs": [{str(t): lp for t, lp in s.top} for s in steps],
            }
            if self.with_logprobs
            else None
        )
        return {**self.envelope([choice], chunk=False), "usage": self.usage(gen)}


class ChatReply(Reply):
    object_name, chunk_object = "chat.completion", "chat.completion.chunk"
    prefix = "chatcmpl-"
    skip_special = True

    def _delta(self, delta: dict[str, str], finish: str | None) -> dict[str, Any]:
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

    def start(self) -> list[dict[str, Any]]:
        choice = self._delta({"role": "assistant", "content": ""}, None)
        return [{**self.envelope([choice], True), **self.first_ids()}]  # beside it, as vLLM

    def chunk(self, piece: str, token: int | None) -> list[dict[str, Any]]:
        if token is not None and self.prompt_ids is not None:  # ids asked for: every token
            choice = {**self._delta({"content": piece}, None), "token_ids": [token]}
            return [self.envelope([choice], True)]
        return [self.envelope([self._delta({"content": piece}, None)], True)] if piece else []

    def end(self, gen: Generation, with_usage: bool = False) -> list[dict[str, Any]]:
        reason = self.finish(gen)
        out = self.chunk(self.rest(), None)
        out.append(self.envelope([self._delta({}, reason)], True))
        if with_usage:
            out.append({**self.envelope([], True), "usage": self.usage(gen)})
        return out

    def body(self, gen: Generation) -> dict[str, Any]:
        reason = self.finish(gen)
        message = {"role": "assistant", "content": self.text}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": reason}
        return {**self.envelope([choice], chunk=False), "usage": self.usage(gen)}
