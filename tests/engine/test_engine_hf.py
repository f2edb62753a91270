"""`--model-impl hf`: tiny transformers models built in the test, served, compared with
`from_pretrained` on the same dir."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import DaemonProc

from engine.launch import EngineProcess
from tests.engine.test_engine_serve import assert_leaving_stops, leave_a_stream, post

transformers = pytest.importorskip("transformers")

WORDS = ["<unk>", "hello", "world", "holdfast", "serves", "tokens", "fast"]


def write_tokenizer(model_dir: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(model_dir / "tokenizer.json"))


def make_models(root: Path) -> tuple[Path, Path]:
    torch.manual_seed(0)
    llama_dir, bert_dir = root / "llama", root / "bert"
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=128,
            max_position_embeddings=128,
            tie_word_embeddings=True,
            eos_token_id=None,
        )
    )
    llama.save_pretrained(llama_dir)
    write_tokenizer(llama_dir)
    bert = transformers.BertModel(
        transformers.BertConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            vocab_size=100,
            max_position_embeddings=64,
        )
    )
    bert.save_pretrained(bert_dir)
    return llama_dir, bert_dir


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("hf")
    llama_dir, bert_dir = make_models(root)
    run = root / "run"
    daemon = DaemonProc(
        ["serve", "--model", str(llama_dir), "--runtime-dir", str(run), "--dtype", "float32"]
    )
    flags = ["--model-impl", "hf", "--dtype", "float32"]
    bert = EngineProcess([*flags, "--model", str(bert_dir), "--allow-disk-fallback"])
    llama = None
    try:
        daemon.wait_serving()
        llama = EngineProcess(
            [*flags, "--model", str(llama_dir), "--daemons", str(run / "daemon-0.sock")]
        )
        llama.wait_ready()
        bert.wait_ready()
        yield {"llama": llama, "bert": bert, "llama_dir": llama_dir, "bert_dir": bert_dir}
    finally:
        for p in (llama, bert):
            if p is not None:
                p.stop()
        daemon.stop()


@torch.inference_mode()
def greedy(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.tensor([prompt])
    for _ in range(n):
        nxt = model(input_ids=ids).logits[0, -1].argmax()
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, len(prompt) :].tolist()


def test_hf_causal_lm_attached_matches_from_pretrained(served: dict[str, Any]) -> None:
    engine = served["llama"]
    assert engine.ready["weights"] == "daemon"
    prompt = [3, 9, 27, 81, 4]
    status, _, body = post(engine.url, {"prompt_token_ids": prompt, "max_tokens": 10})
    assert status == 200, body
    assert body["choices"][0]["token_ids"] == greedy(served["llama_dir"], prompt, 10)


def test_hf_stream_client_that_leaves_stops_its_generation(served: dict[str, Any]) -> None:
    engine = served["llama"]
    assert_leaving_stops(engine, leave_a_stream, max_tokens=120)  # its context is 128
    status, _, body = post(engine.url, {"prompt_token_ids": [3, 9], "max_tokens": 4})
    assert status == 200 and body["choices"][0]["token_ids"] == greedy(
        served["llama_dir"], [3, 9], 4
    )


def test_hf_text_prompt_goes_through_the_tokenizer(served: dict[str, Any]) -> None:
    status, _, body = post(served["llama"].url, {"prompt": "hello holdfast", "max_tokens": 3})
    assert status == 200, body
    choice = body["choices"][0]
    assert body["usage"]["prompt_tokens"] == 2
    assert choice["text"].split() == [
        WORDS[t] if t < len(WORDS) else "<unk>" for t in choice["token_ids"]
    ]


@torch.inference_mode()
def test_hf_encoder_embeddings_match_from_pretrained(served: dict[str, Any]) -> None:
    inputs = [[1, 5, 9, 13], [2, 7]]
    status, _, body = post(served["bert"].url, {"input": inputs}, path="/v1/embeddings")
    assert status == 200, body
    model = transformers.AutoModel.from_pretrained(served["bert_dir"]).eval()
    for item, ids in zip(body["data"], inputs, strict=True):
        want = model(input_ids=torch.tensor([ids])).last_hidden_state[0].mean(0)
        torch.testing.assert_close(torch.tensor(item["embedding"]), want, rtol=1e-4, atol=1e-5)
    status, _, body = post(served["bert"].url, {"prompt_token_ids": [1], "max_tokens": 1})
    assert status == 400 and "/v1/embeddings only" in body["error"]["message"]
