"""Streams through the router survive a kill -9 of the primary: the router continues each
cut stream on the promoted standby by token replay, and the client sees one stream equal
to the same request run without a fault. With no primary to continue on, the stream ends
with an error event and no `[DONE]`, and the official `openai` client raises.

Real `supervisor run`, real engines (`python -m engine`) on the tiny checkpoint; answers are
sized in tokens (long enough that a kill after 20 chunks lands mid-stream)."""

from __future__ import annotations

import http.client
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from holdfast_contract.wire import free_port
from tests.engines.harness import Supervisor, get, write_policy

openai = pytest.importorskip("openai")

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]
TOKENS = 480  # the tiny checkpoint's context is 512
CUT_AFTER = 20  # chunks read before the primary is killed
ENGINE = ["{python}", "-m", "engine"]


def boot(base: Path, model: Path, **sections: Any) -> Supervisor:
    policy = write_policy(
        base / "policy.yaml",
        model,
        base / "run",
        **{
            "engines": {"command": ENGINE, "ready_timeout_s": 120, "stop_grace_s": 5.0},
            "heartbeat": {"interval_ms": 100, "miss_limit": 10},
            **sections,
        },
    )
    return Supervisor(policy)


def stream(router: str, path: str = "/v1/completions", **fields: Any) -> Iterator[bytes]:
    """The data of each server-sent event of one streamed request, as it arrives."""
    host, port = router.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    body = {"stream": True, "ignore_eos": True, **fields}
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    try:
        buf = b""
        while chunk := resp.read1(65536):
            buf += chunk
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                yield event.removeprefix(b"data: ")
    finally:
        conn.close()


def chunks(events: list[bytes]) -> list[dict[str, Any]]:
    """The JSON chunks of a stream (not `[DONE]`, not comments such as `: migrated`)."""
    return [json.loads(d) for d in events if d != b"[DONE]" and not d.startswith(b":")]


def token_ids(events: list[bytes]) -> list[int]:
    ids: list[int] = []
    for chunk in chunks(events):
        if chunk:
            for choice in chunk.get("choices", []):
                ids.extend(choice.get("token_ids") or [])
    return ids


def cut_stream(sup: Supervisor, **fields: Any) -> list[bytes]:
    """A stream whose primary is killed with SIGKILL after CUT_AFTER chunks (its pid asked
    for before the stream, not while the engine writes on)."""
    primary = get(f"{sup.api}/primary")[1]["pid"]
    events: list[bytes] = []
    for data in stream(sup.router, **fields):
        events.append(data)
        if len(events) == CUT_AFTER:
            os.kill(primary, signal.SIGKILL)
    return events


def migrations(sup: Supervisor) -> dict[str, float]:
    text = get_text(f"{sup.api}/metrics")
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name == "holdfast_supervisor_router_migrations":
            for s in family.samples:
                if s.name.endswith("_total"):
                    out[s.labels["outcome"]] = s.value
        if family.name == "holdfast_supervisor_router_stream_stall_seconds":
            for s in family.samples:
                if s.name.endswith("_count"):  # one per `continued` label
                    out["stalls"] = out.get("stalls", 0) + s.value
    return out


def get_text(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as r:
        return str(r.read().decode())


def chat(
    sup: Supervisor, model: str, tokens: int, cut: bool, **fields: Any
) -> tuple[list[int], list[str | None], Any]:
    """One streamed chat through the official `openai` client: its token ids, finish
    reasons and usage; with `cut`, the primary is killed with SIGKILL once CUT_AFTER tokens
    have come (a chunk may carry several: vLLM sends what it made since the last one)."""
    client = openai.OpenAI(base_url=sup.router + "/v1", api_key="-", max_retries=0, timeout=120)
    killed = not cut
    primary = get(f"{sup.api}/primary")[1]["pid"] if cut else 0
    ids: list[int] = []
    finish: list[str | None] = []
    usage = None
    for chunk in client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "When the primary dies, a standby"}],
        max_tokens=tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
        **fields,
    ):
        for choice in chunk.choices:
            ids.extend(getattr(choice, "token_ids", None) or [])
            if choice.finish_reason is not None:
                finish.append(choice.finish_reason)
        usage = chunk.usage or usage
        if not killed and len(ids) >= CUT_AFTER:
            os.kill(primary, signal.SIGKILL)
            killed = True
    return ids, finish, usage


def test_a_stream_cut_by_kill_9_is_continued_on_the_standby(
    tmp_path: Path, tiny_model: Path
) -> None:
    sup = boot(tmp_path, tiny_model)
    try:
        first = sup.wait_pair()
        reference = list(stream(sup.router, prompt_token_ids=PROMPT, max_tokens=TOKENS))
        assert reference[-1] == b"[DONE]" and len(token_ids(reference)) == TOKENS
        mark = sup.tap.mark()
        events = cut_stream(sup, prompt_token_ids=PROMPT, max_tokens=TOKENS)
        promoted = sup.wait(lambda e: e.event == "promoted", timeout=10, after=mark)
        assert promoted.name != first.name and promoted.epoch == first.epoch + 1
        migrated = sup.wait(lambda e: e.topic == "router.main.migrated", timeout=10, after=mark)
        assert 0 < migrated.data["tokens"] < TOKENS
        # one stream: every token once, the same ones as without the fault, a finish, [DONE]
        assert events[-1] == b"[DONE]"
        assert token_ids(events) == token_ids(reference)
        finals = [
            c["finish_reason"]
            for chunk in chunks(events)
            for c in chunk["choices"]
            if c["finish_reason"] is not None
        ]
        assert finals == ["length"]
        assert len({chunk["id"] for chunk in chunks(events)}) == 1
        assert events.count(b": migrated") == 1  # where the continuation began
        counts = migrations(sup)
        assert (counts["attempted"], counts["succeeded"], counts["failed"]) == (1, 1, 0)
        assert counts["stalls"] == 1
        assert sup.stop(signal.SIGTERM) == 0, sup.output()
    finally:
        if sup.proc.poll() is None:
            sup.stop(signal.SIGKILL)


def test_a_cut_stream_with_no_primary_to_continue_on_ends_with_an_error(
    tmp_path: Path, tiny_model: Path
) -> None:
    sup = boot(
        tmp_path,
        tiny_model,
        engines={"command": ENGINE, "standby": 0, "ready_timeout_s": 120},
        router={"listen": f"127.0.0.1:{free_port()}", "retry_deadline_s": 0.5},
        restart={"initial_s": 60.0, "max_s": 60.0, "jitter_s": 0.0},
    )
    try:
        sup.wait(lambda e: e.event == "promoted", timeout=180)
        # raw: an error event in OpenAI's shape, and no [DONE]
        events = cut_stream(sup, prompt_token_ids=PROMPT, max_tokens=TOKENS)
        assert b"[DONE]" not in events
        last = json.loads(events[-1])
        assert set(last) == {"error"} and last["error"]["type"] == "upstream_error"
        assert "retry_deadline_s" in last["error"]["message"]
        assert 0 < len(token_ids(events)) < TOKENS
        assert migrations(sup)["failed"] == 1
    finally:
        sup.stop(signal.SIGKILL)


def test_the_openai_client_raises_on_a_stream_that_cannot_be_continued(
    tmp_path: Path, tiny_model: Path
) -> None:
    sup = boot(
        tmp_path,
        tiny_model,
        engines={"command": ENGINE, "standby": 0, "ready_timeout_s": 120},
        router={"listen": f"127.0.0.1:{free_port()}", "migration_limit": 0},
    )
    try:
        sup.wait(lambda e: e.event == "promoted", timeout=180)
        # killed at the first chunk, its pid asked for before: the engine must still be
        # generating at the kill, and a busy machine's client once read CUT_AFTER chunks
        # and asked the supervisor for the pid while the engine wrote all TOKENS
        primary = get(f"{sup.api}/primary")[1]["pid"]
        client = openai.OpenAI(base_url=sup.router + "/v1", api_key="-", max_retries=0)
        chunks = client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=TOKENS,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        seen = 0
        with pytest.raises(openai.APIError, match="migration_limit"):
            for _ in chunks:
                seen += 1
                if seen == 1:
                    os.kill(primary, signal.SIGKILL)
        assert 1 <= seen < TOKENS
    finally:
        sup.stop(signal.SIGKILL)


def test_a_chat_stream_is_continued_at_the_token_level(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """The continuation of a chat stream is built from token ids (the template is not
    rendered again) and reshaped into chat chunks: the openai client reads one stream with
    the fault-free stream's tokens, its finish_reason, and usage over the whole answer."""
    pytest.importorskip("transformers")
    from hf_checkpoints import llama_checkpoint

    ckpt = llama_checkpoint(tmp_path_factory.mktemp("llama") / "llama", context=1024)
    sup = boot(tmp_path, ckpt)
    n = 900  # long enough to be mid-stream at the kill (like TOKENS for the tiny checkpoint)
    try:
        first = sup.wait_pair()
        reference = chat(sup, "llama", n, cut=False)
        assert len(reference[0]) == n and reference[1] == ["length"]
        mark = sup.tap.mark()
        ids, finish, usage = chat(sup, "llama", n, cut=True)
        sup.wait(lambda e: e.topic == "router.main.migrated", timeout=10, after=mark)
        promoted = sup.wait(lambda e: e.event == "promoted", timeout=10, after=mark)
        assert promoted.name != first.name
        assert ids == reference[0]
        assert finish == ["length"]
        assert usage is not None and usage.completion_tokens == n
        assert usage.prompt_tokens == reference[2].prompt_tokens
        assert usage.total_tokens == usage.prompt_tokens + n
    finally:
        sup.stop(signal.SIGKILL)


def test_a_continuation_is_the_prompt_and_the_tokens_sent_with_the_rest_of_the_budget() -> None:
    from supervisor.proxy.migration import Stream, plan

    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 10}
    body |= {"temperature": 0, "seed": 7, "stop": ["\n\n"], "logprobs": True, "tools": None}
    st = plan("POST", "/v1/chat/completions", json.dumps(body).encode())
    assert isinstance(st, Stream) and st.chat
    assert json.loads(st.first_body())["return_token_ids"] is True
    role = {"id": "chatcmpl-1", "created": 5, "model": "m"}
    choice = {"delta": {"role": "assistant", "content": ""}}
    # a chat chunk carries the prompt's ids beside its choices (vLLM 0.32's shape)
    st.seen({**role, "choices": [choice], "prompt_token_ids": [1, 2, 3]})
    st.seen({**role, "choices": [{"delta": {"content": "a"}, "token_ids": [40, 41]}]})
    assert json.loads(st.continuation()) == {
        "temperature": 0,
        "seed": 7,
        "stop": ["\n\n"],
        "prompt": [1, 2, 3, 40, 41],
        "max_tokens": 8,
        "stream": True,
        "return_token_ids": True,
        "skip_special_tokens": True,
    }
    # a completion chunk of the continuation, reshaped into the chat stream's chunks
    end = st.reshape({"choices": [{"text": "b", "token_ids": [42], "finish_reason": "length"}]})
    assert [c["choices"][0]["delta"] for c in end] == [{"content": "b"}, {}]
    assert [c["choices"][0]["finish_reason"] for c in end] == [None, "length"]
    assert {c["id"] for c in end} == {"chatcmpl-1"}
    for c in end:
        st.seen(c)
    assert st.emitted == [40, 41, 42] and st.finish_reason == "length"
    # other paths, and what the engine answers with a 400, are relayed as they are
    assert plan("GET", "/v1/models", b"") is None
    assert plan("POST", "/v1/completions", b"not json") is None


def test_a_completion_chunk_carries_the_prompt_ids_in_its_choice() -> None:
    """vLLM 0.32's completion chunk, as it streams one: the ids in the first choice."""
    from supervisor.proxy.migration import Stream

    st = Stream("/v1/completions", {"prompt": [3, 14], "max_tokens": 5, "stream": True})
    first = {"index": 0, "text": "k", "finish_reason": None, "stop_reason": None}
    st.seen(
        {"id": "cmpl-8", "choices": [{**first, "prompt_token_ids": [3, 14], "token_ids": [80]}]}
    )
    more = {"index": 0, "text": "#", "finish_reason": None, "prompt_token_ids": None}
    st.seen({"id": "cmpl-8", "choices": [{**more, "token_ids": [8]}]})
    assert st.can_continue() and st.prompt_ids == [3, 14] and st.emitted == [80, 8]
    assert json.loads(st.continuation())["prompt"] == [3, 14, 80, 8]


def test_a_migrated_chat_stream_gets_usage_over_the_whole_answer() -> None:
    from supervisor.proxy.migration import Stream

    st = Stream("/v1/chat/completions", {"stream_options": {"include_usage": True}})
    st.seen({"id": "c", "choices": [{"delta": {}}], "prompt_token_ids": [1, 2]})
    st.seen({"id": "c", "choices": [{"delta": {"content": "x"}, "token_ids": [9, 9, 9]}]})
    st.finish_reason = "stop"
    [usage] = st.closing()
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 3,
        "total_tokens": 5,
    }
    assert st.closing() == []  # once


def test_what_vllm_adds_to_a_finish_reaches_the_client_migrated_or_collected() -> None:
    """vLLM's `stop_reason` (the stop string that ended the answer) and its
    `system_fingerprint` stay in a continuation's reshaped chunks and a collected body."""
    from supervisor.proxy.answers import body
    from supervisor.proxy.migration import Stream

    st = Stream("/v1/completions", {"prompt": [3], "max_tokens": 9, "stop": ["o"]}, collect=True)
    st.seen({"id": "cmpl-1", "choices": [{"text": "a", "prompt_token_ids": [3], "token_ids": [5]}]})
    end = {"text": "b", "token_ids": [6], "finish_reason": "stop", "stop_reason": "o"}
    [chunk] = st.reshape({"choices": [end], "system_fingerprint": "vllm-0.32.0"})
    assert chunk["choices"][0]["stop_reason"] == "o"
    assert chunk["system_fingerprint"] == "vllm-0.32.0"
    st.seen(chunk)
    answer = body(st)
    assert answer["choices"][0]["text"] == "ab" and answer["choices"][0]["stop_reason"] == "o"
    assert answer["system_fingerprint"] == "vllm-0.32.0"
    # the reference engine sends neither: the body has neither
    plain = Stream("/v1/completions", {"prompt": [3]}, collect=True)
    plain.seen({"id": "c", "choices": [{"text": "a", "token_ids": [5], "finish_reason": "length"}]})
    assert "stop_reason" not in body(plain)["choices"][0]
    assert "system_fingerprint" not in body(plain)
