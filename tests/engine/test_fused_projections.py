"""q|k|v and gate|up read as one matrix each: a pool lays them side by side, an engine
attached to it multiplies each group once through a view of the pool (no copy), answers
as it did with separate products, and a refit's new weights reach the fused reads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from cachedaemon import refit
from cachedaemon.checkpoint import CheckpointReader
from cachedaemon.checkpoint_gen import make_checkpoint
from cachedaemon.client import assign, attach_model
from cachedaemon.config import LoadOptions, make_config
from cachedaemon.loader import load_state_dict
from cachedaemon.pool_plan import GEOMETRY, layout, plan, side_by_side
from engine.job import Step
from engine.kvcache import KVCache
from engine.model import DecoderLayer, LlamaForCausalLM, TPGroup
from engine.modelargs import read_model_args
from engine.runner import Runner
from engine.scheduler import Plan, Seq

DEVICES = ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)]
PROMPTS = ((5, 17, 99, 3, 250, 42, 7), (11, 12, 13), (200,) * 20)


def test_the_order_puts_each_group_together_where_its_first_member_was() -> None:
    names = [
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.0.self_attn.q_proj.bias",
        "model.layers.0.self_attn.k_proj.bias",
        "model.layers.0.self_attn.v_proj.bias",
    ]
    got = [names[i] for i in side_by_side(names)]
    assert got == [
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.self_attn.q_proj.bias",
        "model.layers.0.self_attn.k_proj.bias",
        "model.layers.0.self_attn.v_proj.bias",
    ]
    assert sorted(got) == sorted(names)


@pytest.mark.parametrize("backend", sorted(GEOMETRY))
def test_a_pool_lays_each_group_end_to_end(tiny_model: Path, backend: str) -> None:
    with CheckpointReader(tiny_model) as reader:
        specs = [o for sp in plan(reader, LoadOptions()) for o in sp.outputs]
    places, _ = layout(specs, GEOMETRY[backend])
    at = {s.name: p for s, p in zip(specs, places, strict=True)}
    for i in range(2):
        for group in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            part = "self_attn" if "q_proj" in group else "mlp"
            spots = [at[f"model.layers.{i}.{part}.{m}.weight"] for m in group]
            for (chunk, offset, nbytes), (chunk2, offset2, _) in zip(
                spots, spots[1:], strict=False
            ):
                assert (chunk2, offset2) == (chunk, offset + nbytes)


def _model(model_dir: Path, device: str) -> LlamaForCausalLM:
    return LlamaForCausalLM(read_model_args(model_dir), TPGroup(), torch.float32, device=device)


def _answers(model: LlamaForCausalLM, device: str, steps: int = 6) -> list[list[Step]]:
    """Greedy answers to PROMPTS, prefilled in one step and decoded together."""
    a = model.args
    cache = KVCache(
        a.num_hidden_layers, a.num_key_value_heads, a.head_dim, 2, torch.float32, device
    )
    runner = Runner(model, torch.device(device), cache, max_batch=4, max_len=64, cuda_graphs=False)
    seqs = []
    for i, prompt in enumerate(PROMPTS):
        s = Seq(prompt, steps, ignore_eos=True, top_logprobs=3)
        s.blocks = list(range(4 * i, 4 * i + 4))
        seqs.append(s)
    plan_: Plan = Plan(prefill=tuple(seqs))
    with torch.inference_mode():
        for _ in range(steps):
            for s, st in zip(seqs, runner.step(plan_), strict=True):
                s.out.append(st)
            plan_ = Plan(decode=tuple(seqs))
    return [s.out for s in seqs]


def _same(got: list[list[Step]], want: list[list[Step]]) -> None:
    for g, w in zip(got, want, strict=True):
        assert [s.token for s in g] == [s.token for s in w]
        assert [s.logprob for s in g] == pytest.approx([s.logprob for s in w], abs=1e-4)


def _unfused(model: LlamaForCausalLM) -> None:
    for layer in model.model.layers:
        assert isinstance(layer, DecoderLayer)
        layer.self_attn.qkv = layer.mlp.gate_up = None


@pytest.mark.parametrize("device", DEVICES)
def test_an_attached_engine_reads_each_group_as_one_view_and_answers_alike(
    tmp_path: Path, tiny_model: Path, start_daemon: Any, device: str
) -> None:
    start_daemon(tiny_model, tmp_path, "--dtype", "float32", "--device", device)
    model = _model(tiny_model, device)
    attach_model(
        model, tmp_path / "daemon-0.sock", make_config(tiny_model, dtype="float32", device=device)
    )
    layers = model.args.num_hidden_layers
    assert model.fuse_projections() == 2 * layers
    for layer in model.model.layers:
        assert isinstance(layer, DecoderLayer)
        attn, mlp = layer.self_attn, layer.mlp
        assert attn.qkv is not None and mlp.gate_up is not None
        # a view of the pool where q_proj starts, as many rows as the three: no copy
        assert attn.qkv.weight.data_ptr() == attn.q_proj.weight.data_ptr()
        assert attn.qkv.weight.shape[0] == sum(
            p.weight.shape[0] for p in (attn.q_proj, attn.k_proj, attn.v_proj)
        )
        assert torch.equal(attn.qkv.weight[-attn.v_proj.weight.shape[0] :], attn.v_proj.weight)
        assert mlp.gate_up.weight.data_ptr() == mlp.gate_proj.weight.data_ptr()
        assert torch.equal(mlp.gate_up.weight[mlp.gate_proj.weight.shape[0] :], mlp.up_proj.weight)
    fused = _answers(model, device)
    _unfused(model)
    _same(fused, _answers(model, device))


def test_tensors_of_their_own_are_not_fused_and_still_answer(tiny_model: Path) -> None:
    model = _model(tiny_model, "cpu")
    assign(model, load_state_dict(tiny_model, LoadOptions(dtype="float32")))
    assert model.fuse_projections() == 0
    assert all(len(steps) == 6 for steps in _answers(model, "cpu"))


def test_a_refit_reaches_the_fused_reads(tmp_path: Path, start_daemon: Any) -> None:
    a = make_checkpoint(tmp_path / "a", "tiny", seed=0)
    b = make_checkpoint(tmp_path / "b", "tiny", seed=1)
    start_daemon(a, tmp_path / "run-a", "--dtype", "float32")
    start_daemon(b, tmp_path / "run-b", "--dtype", "float32")
    model = _model(a, "cpu")
    attach_model(model, tmp_path / "run-a" / "daemon-0.sock", make_config(a, dtype="float32"))
    assert model.fuse_projections() > 0
    before = _answers(model, "cpu")
    state = dict(model.named_parameters())
    r = refit.fetch(tmp_path / "run-b" / "daemon-0.sock", make_config(b, dtype="float32"), state)
    r.swap()
    after = _answers(model, "cpu")
    fresh = _model(b, "cpu")
    assign(fresh, load_state_dict(b, LoadOptions(dtype="float32")))
    want = _answers(fresh, "cpu")
    _same(after, want)
    assert [s.token for s in before[0]] != [s.token for s in want[0]]  # the seeds differ
