"""Non-streamed completions and chat completions through the router survive a kill -9 of
the primary mid-generation: the router asks the engine for a stream, migrates it by token
replay like any stream, and answers with one JSON body equal, field by field, to the
engine's own non-streamed reply to the same request without a fault. With no primary to
continue on, the client gets a 502 in OpenAI's error shape, never a short answer.

Real `supervisor run`, real engines (`python -m engine`); answers are sized in tokens, and
the kill comes once the primary has run CUT_AFTER steps of the request (its /metrics). A
request the engine ran whole between two looks at its steps (a machine busy enough that
the test waited longer than N steps) is asked again, up to ATTEMPTS times, so that it is
cut mid-generation however fast the engine runs."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from holdfast_contract.wire import free_port
from supervisor.proxy.answers import body as collected_body
from supervisor.proxy.migration import Stream, plan
from tests.engines.harness import Supervisor, get
from tests.supervisor.proxy.test_router_streams import PROMPT, TOKENS, boot, get_text, migrations

CUT_AFTER = 20  # model steps of the request run before its primary is killed
N = 900  # tokens asked of the llama checkpoint (context 1024)
ATTEMPTS = 3  # requests sent before one is seen mid-generation
TEXT = "When the primary dies, a standby"
MESSAGES = [{"role": "user", "content": TEXT}]
Reply = tuple[int, dict[str, str], dict[str, Any]]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama with a real BPE tokenizer and a chat template: answers have text."""
    pytest.importorskip("transformers")
    from hf_checkpoints import llama_checkpoint

    return llama_checkpoint(tmp_path_factory.mktemp("llama") / "llama", context=1024)


def post(base: str, path: str, fields: dict[str, Any]) -> Reply:
    """One non-streamed request: (status, headers, JSON body)."""
    req = urllib.request.Request(
        base + path, json.dumps(fields).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def engine_steps(port: int) -> float:
    """Model steps the engine on `port` has run (its /metrics)."""
    for family in text_string_to_metric_families(get_text(f"http://127.0.0.1:{port}/metrics")):
        if family.name == "holdfast_engine_steps":
            return float(family.samples[0].value)
    raise AssertionError("the engine's /metrics has no holdfast_engine_steps")


def cut(
    sup: Supervisor,
    path: str,
    fields: dict[str, Any],
    tokens: int,
    progress: Callable[[int], float] = engine_steps,
) -> Reply:
    """The request through the router, its primary killed with SIGKILL once the primary
    has run CUT_AFTER steps of it (it runs nothing else), before its last token.
    `progress`: the steps (or tokens) the engine on a port has run so far."""
    for _ in range(ATTEMPTS):
        primary = get(f"{sup.api}/primary")[1]
        start = progress(primary["port"])
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(post, sup.router, path, fields)
            deadline = time.monotonic() + 60
            while (steps := progress(primary["port"]) - start) < CUT_AFTER:
                assert time.monotonic() < deadline and not answer.done(), "the request never ran"
                time.sleep(0.005)
            if steps < tokens:
                os.kill(primary["pid"], signal.SIGKILL)
                return answer.result(timeout=120)
            status, _, whole = answer.result(timeout=120)  # done before the look: again
            assert status == 200, whole
    raise AssertionError(f"the request was done before the kill {ATTEMPTS} times")


def same_reply(got: dict[str, Any], want: dict[str, Any], version: str = "") -> None:
    """Equal field by field, but for the answer's own id and time; a router's answer
    (`version`: its X-Holdfast-Model-Version) also names that version as its
    `system_fingerprint`, which the engine's own lacks."""
    if version:
        got = dict(got)
        assert got.pop("system_fingerprint") == version
    assert got["id"].split("-")[0] == want["id"].split("-")[0] and got["id"] != want["id"]
    assert isinstance(got["created"], int) and abs(got["created"] - want["created"]) < 600
    strip = {"id", "created"}
    assert {k: v for k, v in got.items() if k not in strip} == {
        k: v for k, v in want.items() if k not in strip
    }


def survives(sup: Supervisor, path: str, fields: dict[str, Any]) -> dict[str, Any]:
    """The engine's own reply, the router's fault-free one, and the router's with a kill
    mid-generation: the three the same, the kill migrated once; the reply."""
    first = sup.wait_pair()
    # the router's first (it waits for the promotion to be taken), then the engine's own
    status, headers, plain = post(sup.router, path, fields)
    assert status == 200 and headers["X-Holdfast-Engine"] == first.name, plain
    primary = get(f"{sup.api}/primary")[1]
    status, _, engine = post(f"http://127.0.0.1:{primary['port']}", path, fields)
    assert status == 200, engine
    same_reply(plain, engine, headers["X-Holdfast-Model-Version"])
    assert migrations(sup).get("attempted", 0) == 0
    mark = sup.tap.mark()
    status, headers, migrated = cut(sup, path, fields, N)
    promoted = sup.wait(lambda e: e.event == "promoted", timeout=10, after=mark)
    assert promoted.name != first.name
    assert status == 200, migrated
    same_reply(migrated, engine, headers["X-Holdfast-Model-Version"])
    assert headers["X-Holdfast-Engine"] == promoted.name  # the engine that finished it
    assert headers["Content-Type"].startswith("application/json")
    event = sup.wait(lambda e: e.topic == "router.main.migrated", timeout=10, after=mark)
    assert 0 < event.data["tokens"] < N
    counts = migrations(sup)
    assert (counts["attempted"], counts["succeeded"], counts["failed"]) == (1, 1, 0)
    return migrated


def test_a_completion_cut_by_kill_9_is_answered_whole_after_migration(
    tmp_path: Path, llama: Path
) -> None:
    sup = boot(tmp_path, llama)
    try:
        fields = {"prompt": TEXT, "max_tokens": N, "ignore_eos": True}
        reply = survives(sup, "/v1/completions", fields)
        [choice] = reply["choices"]
        assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == N
        assert choice["text"] and reply["usage"]["completion_tokens"] == N
        assert reply["usage"]["total_tokens"] == reply["usage"]["prompt_tokens"] + N
        # what the engine refuses comes back as the engine answers the request as sent
        status, _, refused = post(sup.router, "/v1/completions", {**fields, "max_tokens": 10**6})
        assert status == 400 and refused["error"]["param"] == "max_tokens", refused
        assert sup.stop(signal.SIGTERM) == 0, sup.output()
    finally:
        sup.stop(signal.SIGKILL)


def test_a_chat_completion_cut_by_kill_9_is_answered_whole_after_migration(
    tmp_path: Path, llama: Path
) -> None:
    """The openai client reads the migrated reply as any other."""
    openai = pytest.importorskip("openai")
    sup = boot(tmp_path, llama)
    try:
        fields = {"messages": MESSAGES, "max_tokens": N, "ignore_eos": True}
        reply = survives(sup, "/v1/chat/completions", fields)
        [choice] = reply["choices"]
        assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
        assert choice["finish_reason"] == "length"
        assert reply["usage"]["completion_tokens"] == N
        client = openai.OpenAI(base_url=sup.router + "/v1", api_key="-", max_retries=0)
        again = client.chat.completions.create(
            model=reply["model"], messages=MESSAGES, max_tokens=N, extra_body={"ignore_eos": True}
        )
        assert again.choices[0].message.content == choice["message"]["content"]
        assert again.usage is not None and again.usage.completion_tokens == N
    finally:
        sup.stop(signal.SIGKILL)


def test_a_completion_with_no_primary_to_continue_on_gets_a_502(
    tmp_path: Path, tiny_model: Path
) -> None:
    sup = boot(
        tmp_path,
        tiny_model,
        engines={"command": ["{python}", "-m", "engine"], "standby": 0, "ready_timeout_s": 120},
        router={"listen": f"127.0.0.1:{free_port()}", "retry_deadline_s": 0.5},
        restart={"initial_s": 60.0, "max_s": 60.0, "jitter_s": 0.0},
    )
    try:
        sup.wait(lambda e: e.event == "promoted", timeout=180)
        fields = {"prompt_token_ids": PROMPT, "max_tokens": TOKENS, "ignore_eos": True}
        status, headers, reply = cut(sup, "/v1/completions", fields, TOKENS)
        assert status == 502 and headers["Content-Type"].startswith("application/json")
        assert set(reply) == {"error"} and reply["error"]["type"] == "upstream_error"
        assert "retry_deadline_s" in reply["error"]["message"]
        counts = migrations(sup)
        assert (counts["attempted"], counts["succeeded"], counts["failed"]) == (1, 0, 1)
    finally:
        sup.stop(signal.SIGKILL)


def test_non_streamed_requests_are_collected_only_when_the_stream_can_rebuild_them() -> None:
    def planned(path: str, **fields: Any) -> Stream | None:
        return plan("POST", path, json.dumps(fields).encode())

    chat = planned("/v1/chat/completions", messages=[], max_tokens=4)
    assert chat is not None and chat.collect
    sent = json.loads(chat.first_body())
    assert sent["stream"] is True and sent["return_token_ids"] is True
    assert sent["stream_options"] == {"include_usage": True}
    assert planned("/v1/completions", prompt=[1, 2], stream=False) is not None
    # what the chunks cannot rebuild goes as bytes, retried only before its first byte
    for fields in (
        {"prompt": "a", "logprobs": 1},
        {"prompt": "a", "logprobs": 0},
        {"prompt": "a", "echo": True},
        {"prompt": "a", "n": 2},
        {"prompt": "a", "best_of": 2},
        {"prompt": ["a", "b"]},
        {"prompt": [[1], [2]]},
        {"prompt": "a", "suffix": "z"},
        {"prompt": "a", "return_token_ids": True},
        {"prompt": "a", "stream": "yes"},
    ):
        assert planned("/v1/completions", **fields) is None, fields
    refused = ({"logprobs": True}, {"top_logprobs": 2}, {"tools": []}, {"n": 3})
    for fields in (*refused, {"response_format": {"type": "json_object"}}):
        assert planned("/v1/chat/completions", messages=[], **fields) is None, fields


def test_a_cut_rewinds_the_tokens_whose_text_was_held_back() -> None:
    """Part of a character held back by the engine at the cut is made again by the
    continuation (nothing reached the client), not lost from the text."""
    st = Stream("/v1/completions", {"prompt": "x", "max_tokens": 5}, collect=True)
    env = {"id": "cmpl-1", "created": 7, "model": "m"}
    st.seen({**env, "choices": [{"text": "a", "token_ids": [10], "prompt_token_ids": [1]}]})
    st.seen({**env, "choices": [{"text": "", "token_ids": [195]}]})  # half of a character
    st.rewind()
    assert st.emitted == [10] and json.loads(st.continuation())["max_tokens"] == 4
    for piece, token in (("", 195), ("é", 169), ("b", 11), ("c", 12)):
        st.seen({**env, "choices": [{"text": piece, "token_ids": [token]}]})
    assert st.held == 0 and st.complete()
    st.closing()
    assert collected_body(st) == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 7,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "text": "aébc",
                "token_ids": [10, 195, 169, 11, 12],
                "finish_reason": "length",
                "logprobs": None,
            }
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 5, "total_tokens": 6},
    }
