"""The engine's model, in-process: HF parity, KV-cache decoding, fp8-block dequant on use."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cachedaemon.client import assign
from cachedaemon.loader import LoadOptions, load_state_dict
from cachedaemon.quant import fp8_block_dequantize
from engine.attention import Batch
from engine.errors import ModelConfigError
from engine.kvcache import KVCache
from engine.model import LlamaForCausalLM, TPGroup
from engine.modelargs import check_tp, read_model_args


def build(model_dir: Path, *, quantization: str = "none") -> LlamaForCausalLM:
    args = read_model_args(model_dir)
    model = LlamaForCausalLM(args, TPGroup(), torch.float32, fp8=quantization == "fp8-block")
    assign(
        model, load_state_dict(model_dir, LoadOptions(dtype="float32", quantization=quantization))
    )
    return model


class Stream:
    """One sequence through the paged cache (blocks 0, 1, ... in order, so slot = position):
    the first call prefills, each later call feeds one token; each returns the last logits."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        a = model.args
        self.model, self.pos = model, 0
        self.cache = KVCache(
            a.num_hidden_layers, a.num_key_value_heads, a.head_dim, 1, torch.float32, "cpu"
        )

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        n, start = ids.shape[0], self.pos
        positions = torch.arange(start, start + n)
        if start == 0:
            batch = Batch(positions, positions, torch.tensor([n - 1]), bounds=(0, n))
        else:
            assert n == 1
            blocks = torch.arange(start // self.cache.block_size + 1, dtype=torch.int32)
            batch = Batch(
                positions,
                positions,
                torch.tensor([0]),
                tables=blocks[None],
                lengths=torch.tensor([start + 1], dtype=torch.int32),
            )
        self.pos += n
        return self.model(ids, batch, self.cache)[0]


@torch.inference_mode()
def test_decoding_with_the_cache_equals_recomputing_the_prefix(tiny_model: Path) -> None:
    model = build(tiny_model)
    ids = torch.tensor([5, 17, 99, 3, 250, 42, 7])
    stream = Stream(model)
    steps = [stream(ids[:4])] + [stream(ids[i : i + 1]) for i in range(4, 7)]
    for n, logits in zip(range(4, 8), steps, strict=True):
        full = Stream(model)(ids[:n])
        torch.testing.assert_close(logits, full, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_fp8_block_weights_stay_fp8_and_match_dequantized_ones(tiny_model: Path) -> None:
    fp8 = build(tiny_model, quantization="fp8-block")
    q_proj = fp8.model.layers[0].self_attn.q_proj
    assert q_proj.weight.dtype == torch.float8_e4m3fn
    reference = build(tiny_model)
    state = load_state_dict(tiny_model, LoadOptions(dtype="float32", quantization="fp8-block"))
    for name, module in reference.named_modules():
        scale = state.get(f"{name}.weight_scale_inv")
        if scale is not None:
            w = fp8_block_dequantize(state[f"{name}.weight"], scale)
            module.weight = torch.nn.Parameter(w, requires_grad=False)
    ids = torch.tensor([1, 2, 3, 4, 5])
    got, want = Stream(fp8)(ids), Stream(reference)(ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    plain = Stream(build(tiny_model))(ids)
    assert not torch.equal(got, plain)  # the quantized pool really was used


def test_unsupported_architecture_names_the_flag(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["BertModel"]}')
    with pytest.raises(ModelConfigError, match="--model-impl hf"):
        read_model_args(tmp_path)


def test_tp_size_that_does_not_divide_heads_is_refused(tiny_model: Path) -> None:
    with pytest.raises(ModelConfigError, match="num_attention_heads=4 .*--world-size 3"):
        check_tp(read_model_args(tiny_model), 3)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@torch.inference_mode()
def test_logits_equal_transformers(arch: str, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=128,
    )
    if arch == "llama":  # untied head, Llama 3 rope scaling
        config = transformers.LlamaConfig(
            **common,
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        )
        cls = transformers.LlamaForCausalLM
    else:  # q/k/v biases, tied head
        config = transformers.Qwen2Config(**common, tie_word_embeddings=True)
        cls = transformers.Qwen2ForCausalLM
    torch.manual_seed(0)
    hf = cls(config).eval()
    hf.save_pretrained(tmp_path)
    ours = build(tmp_path)
    ids = torch.randint(0, 256, (12,))
    want = hf(ids[None]).logits[0]
    stream = Stream(ours)
    torch.testing.assert_close(stream(ids[:9]), want[8], rtol=1e-4, atol=1e-5)
    for t in range(9, 12):
        torch.testing.assert_close(stream(ids[t : t + 1]), want[t], rtol=1e-4, atol=1e-5)
