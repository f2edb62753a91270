"""The official `openai` client against the engine and the router, on a checkpoint written
by transformers itself: greedy tokens equal `model.generate`, native and `--model-impl hf`,
for text and chat prompts; through `supervisor run`, a kill -9 of the primary mid-run fails
no request that had not started streaming."""

from __future__ import annotations

import json
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import DaemonProc
from hf_checkpoints import llama_checkpoint

from engine.launch import EngineProcess
from tests.engine.test_engine_serve import in_flight, post
from tests.engines.harness import Supervisor, write_policy

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")

TEXT = "When the primary dies, a standby"
CHATS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "Hello world! How are you today?"}],
    [
        {"role": "system", "content": "You keep weights resident."},
        {"role": "user", "content": "The router retries requests."},
    ],
]
N = 12
LONG = 900  # tokens of the probe a kill -9 cuts: long enough to be in flight at the kill


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return llama_checkpoint(tmp_path_factory.mktemp("llama") / "llama", context=1024)


@pytest.fixture(scope="module")
def bare_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint with its chat template taken out."""
    bare = tmp_path_factory.mktemp("bare") / "tiny"
    shutil.copytree(tiny_model, bare)
    config = bare / "tokenizer_config.json"
    data = json.loads(config.read_text())
    data.pop("chat_template", None)
    config.write_text(json.dumps(data))
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    return bare


@pytest.fixture(scope="module")
def engines(ckpt: Path, bare_model: Path) -> Iterator[dict[str, EngineProcess]]:
    """The checkpoint served natively and by transformers, both attached from one daemon,
    and a template-less checkpoint."""
    run = ckpt.parent / "run"
    daemon = DaemonProc(
        ["serve", "--model", str(ckpt), "--runtime-dir", str(run), "--dtype", "float32"]
    )
    flags = ["--model", str(ckpt), "--dtype", "float32", "--daemons", str(run / "daemon-0.sock")]
    procs: dict[str, EngineProcess] = {}
    try:
        daemon.wait_serving()
        procs["llama"] = EngineProcess(flags)
        procs["hf"] = EngineProcess([*flags, "--model-impl", "hf"])
        procs["bare"] = EngineProcess(["--model", str(bare_model), "--allow-disk-fallback"])
        for p in procs.values():
            p.wait_ready()
        yield procs
    finally:
        for p in procs.values():
            p.stop()
        daemon.stop()


def client(url: str) -> Any:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


@torch.inference_mode()
def generate(ckpt: Path, ids: list[int]) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    out = model.generate(torch.tensor([ids]), max_new_tokens=N, do_sample=False)
    return list(out[0, len(ids) :].tolist())


@pytest.mark.parametrize("impl", ["llama", "hf"])
def test_text_prompt_gives_generates_tokens(
    engines: dict[str, EngineProcess], ckpt: Path, impl: str
) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    want = generate(ckpt, tok(TEXT)["input_ids"])
    reply = client(engines[impl].url).completions.create(
        model="llama", prompt=TEXT, max_tokens=N, temperature=0
    )
    choice = reply.choices[0]
    assert choice.model_extra["token_ids"] == want
    assert choice.text == tok.decode(want)
    assert reply.usage.prompt_tokens == len(tok(TEXT)["input_ids"])


@pytest.mark.parametrize("impl", ["llama", "hf"])
def test_chat_gives_generates_tokens_streamed_or_not(
    engines: dict[str, EngineProcess], ckpt: Path, impl: str
) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    api = client(engines[impl].url)
    for messages in CHATS:
        ids = tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
        want = generate(ckpt, ids)
        reply = api.chat.completions.create(
            model="llama", messages=messages, max_tokens=N, temperature=0
        )
        content = reply.choices[0].message.content
        assert content == tok.decode(want, skip_special_tokens=True)
        assert reply.usage.completion_tokens == len(want)
        assert reply.usage.prompt_tokens == len(ids)
        assert reply.choices[0].finish_reason == ("stop" if len(want) < N else "length")
        stream = api.chat.completions.create(
            model="llama",
            messages=messages,
            max_completion_tokens=N,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == content
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == (
            reply.choices[0].finish_reason
        )
        assert chunks[-1].usage.completion_tokens == len(want)


def test_stop_strings_end_the_text_before_them(engines: dict[str, EngineProcess]) -> None:
    api = client(engines["llama"].url)
    messages = CHATS[0]
    full = api.chat.completions.create(
        model="llama", messages=messages, max_tokens=40, extra_body={"ignore_eos": True}
    )
    content = full.choices[0].message.content
    stop = content[len(content) // 2 : len(content) // 2 + 2]
    assert len(stop) == 2, content
    cut = content[: content.find(stop)]
    for stream in (False, True):
        reply = api.chat.completions.create(
            model="llama",
            messages=messages,
            max_tokens=40,
            stop=[stop],
            stream=stream,
            extra_body={"ignore_eos": True},
        )
        if stream:
            chunks = list(reply)
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            text, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
        assert (text, finish) == (cut, "stop")


def test_models_lists_the_checkpoint(engines: dict[str, EngineProcess]) -> None:
    assert [m.id for m in client(engines["llama"].url).models.list()] == ["llama"]


def bad_request(call: Any, **kwargs: Any) -> Any:
    with pytest.raises(openai.BadRequestError) as info:
        call(model="llama", **kwargs)
    error = info.value.body
    assert set(error) == {"message", "type", "param", "code"}, error
    return error


def test_refusals_in_openai_shape(engines: dict[str, EngineProcess]) -> None:
    api = client(engines["llama"].url)
    create, hi = api.chat.completions.create, [{"role": "user", "content": "hi"}]
    err = bad_request(create, messages=hi, temperature=0.7, top_p=0.5)
    assert "temperature=0.7" in err["message"] and "top_p=0.5" in err["message"]
    assert err["param"] == "temperature"
    assert bad_request(api.completions.create, prompt="hi", n=2)["param"] == "n"
    assert "`messages` is empty" in bad_request(create, messages=[])["message"]
    err = bad_request(create, messages=[{"role": "wizard", "content": "hi"}])
    assert err["param"] == "messages[0].role" and "'wizard'" in err["message"]
    err = bad_request(create, messages=hi, max_tokens=10**6)
    assert "--max-tokens-cap" in err["message"]
    err = bad_request(client(engines["bare"].url).chat.completions.create, messages=hi)
    assert "checkpoint has no chat template" in err["message"]
    status, _, body = post(engines["llama"].url, {"input": "hi"}, path="/v1/embeddings")
    assert status == 400 and "/v1/completions and /v1/chat/completions only" in str(body)


class Traffic:
    """OpenAI clients in threads through the router: streamed chats and completions."""

    def __init__(self, router: str) -> None:
        self.api = client(router)
        self.ok = 0
        self.failed: list[str] = []  # failed before any byte of the reply: must not happen
        self.cut: list[str] = []  # streams cut after they started (the primary died)
        self.stop = threading.Event()
        self.go = threading.Event()  # cleared: no client starts another request
        self.go.set()
        self.cond = threading.Condition()
        self.threads = [threading.Thread(target=self.run, args=(i,)) for i in range(2)]
        for t in self.threads:
            t.start()

    def once(self, stream: bool) -> None:
        extra = {"ignore_eos": True}
        if not stream:
            reply = self.api.completions.create(
                model="llama", prompt=TEXT, max_tokens=24, extra_body=extra
            )
            assert len(reply.choices[0].model_extra["token_ids"]) == 24
            return
        started = False
        try:
            chunks = self.api.chat.completions.create(
                model="llama", messages=CHATS[0], max_tokens=24, stream=True, extra_body=extra
            )
            for chunk in chunks:
                started = True
                finish = chunk.choices[0].finish_reason
            assert finish == "length"
        except (openai.APIError, AssertionError) as e:
            if not started:
                raise
            self.cut.append(repr(e))

    def run(self, i: int) -> None:
        n = 0
        while not self.stop.is_set():
            self.go.wait()
            try:
                self.once(stream=(n + i) % 2 == 0)
                with self.cond:
                    self.ok += 1
                    self.cond.notify_all()
            except (openai.APIError, AssertionError) as e:
                self.failed.append(repr(e))
            n += 1

    def wait_ok(self, more: int, timeout: float) -> None:
        with self.cond:
            target = self.ok + more
            assert self.cond.wait_for(lambda: self.ok >= target, timeout), (self.ok, self.failed)

    def close(self) -> None:
        self.stop.set()
        self.go.set()
        for t in self.threads:
            t.join(120)


def long_completion(api: Any) -> tuple[str, int]:
    raw = api.completions.with_raw_response.create(
        model="llama", prompt=TEXT, max_tokens=LONG, extra_body={"ignore_eos": True}
    )
    return raw.headers["X-Holdfast-Engine"], len(raw.parse().choices[0].model_extra["token_ids"])


def wait_in_flight(router: str, want: Any, timeout: float = 60.0) -> None:
    """Until the primary's in-flight count satisfies `want` (the router forwards /metrics
    to the primary)."""
    deadline = time.monotonic() + timeout
    while not want(in_flight(router)):
        assert time.monotonic() < deadline, f"in-flight requests never as wanted: {want}"
        time.sleep(0.005)


def test_openai_client_through_the_router_survives_kill_9(ckpt: Path, tmp_path: Path) -> None:
    policy = write_policy(
        tmp_path / "policy.yaml",
        ckpt,
        tmp_path / "run",
        engines={"command": ["{python}", "-m", "engine"], "ready_timeout_s": 120},
        heartbeat={"interval_ms": 100, "miss_limit": 10},
    )
    sup = Supervisor(policy)
    try:
        first = sup.wait_pair()
        api = client(sup.router)
        assert [m.id for m in api.models.list()] == ["llama"]
        traffic = Traffic(sup.router)
        probe: list[Any] = []
        sender = threading.Thread(target=lambda: probe.append(long_completion(api)))
        try:
            traffic.wait_ok(4, timeout=120)
            traffic.go.clear()  # the clients' requests end, and no new one starts...
            wait_in_flight(sup.router, lambda n: n == 0)
            sender.start()
            wait_in_flight(sup.router, lambda n: n >= 1)  # ...so this one is the probe
            traffic.go.set()
            second = sup.kill_primary(first)
            sender.join(120)
            traffic.wait_ok(6, timeout=120)
        finally:
            traffic.close()
        assert traffic.failed == [], traffic.failed
        assert traffic.ok >= 10
        # sent to the first primary, answered in full by the next: the router retried it
        [(engine, tokens)] = probe
        assert (engine, tokens) == (second.name, LONG)
        reply = api.chat.completions.create(model="llama", messages=CHATS[0], max_tokens=4)
        assert reply.choices[0].message.role == "assistant"
        assert sup.stop(signal.SIGTERM) == 0, sup.output()
    finally:
        if sup.proc.poll() is None:
            sup.stop(signal.SIGKILL)
