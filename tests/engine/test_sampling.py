"""The step's sampling on the Triton kernels (engine/sampling.py `sample_kernel`) against the
eager math (`sample`), and `fused.rope_store` reading each position's rotation from a table
(`LlamaForCausalLM.rotations`) against cos and sin made for each token.

On a CPU machine the kernels run in Triton's interpreter, in a child process (TRITON_INTERPRET
must be set before triton makes its kernels, and this process may have made them already);
with CUDA the same cases run on the GPU, and a `gpu` test adds llama's vocabulary at 128
rows.

The greedy token must be the argmax of the logits, ties to the lowest index; the top K must
be the K largest in order (ties in index order: torch.topk leaves their order open, so the
check compares values, and ids where no value repeats); logprobs agree to float32 rounding.
"""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.triton_interpreter import run_interpreted

if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton (pip install triton)", allow_module_level=True)

K = 5
# (rows, vocab, k, dtype, ties): a vocabulary of several pieces and one cut mid-piece, one
# smaller than K, bf16 logits as the head makes them, and rows whose top values repeat
CASES: list[tuple[int, int, int, str, bool]] = [
    (1, 5000, K, "bfloat16", True),
    (3, 4099, K, "float32", True),
    (2, 3, K, "float32", False),
    (4, 2048, 1, "bfloat16", False),
    (2, 9000, 8, "float32", True),
]


def logits_for(rows: int, vocab: int, dtype: str, ties: bool, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 3
    if ties and vocab > 100:
        top = x.max(dim=-1).values
        x[:, 17], x[:, vocab - 1] = top, top  # the row's max three times over
        x[:, 40], x[:, 41] = top - 1, top - 1
    return x.to(getattr(torch, dtype))


def compare(device: str, cases: list[tuple[int, int, int, str, bool]]) -> list[dict[str, Any]]:
    from engine.sampling import sample, sample_kernel

    out = []
    for i, (rows, vocab, k, dtype, ties) in enumerate(cases):
        x = logits_for(rows, vocab, dtype, ties, seed=i).to(device)
        got, want = sample_kernel(x, k).cpu(), sample(x, k).cpu()
        kk = min(k, vocab)
        ids, vals = got[:, 2 : 2 + kk], got[:, 2 + kk :]
        want_vals = want[:, 2 + kk :]
        # the kernel's top K: the largest values, each id's own logprob, ties by index
        logp = torch.log_softmax(x.float().cpu(), dim=-1)
        own = logp.gather(-1, ids.long())
        ordered = all(
            (a > b) or (a == b and ia < ib)
            for r in range(rows)
            for (a, ia), (b, ib) in zip(
                zip(vals[r].tolist(), ids[r].tolist(), strict=True),
                list(zip(vals[r].tolist(), ids[r].tolist(), strict=True))[1:],
                strict=False,
            )
        )
        out.append(
            {
                "shape": [rows, vocab, k],
                "width": [got.shape[1], want.shape[1]],
                "greedy_equal": torch.equal(got[:, 0], want[:, 0]),
                "greedy_logprob_diff": (got[:, 1] - want[:, 1]).abs().max().item(),
                "top_values_diff": (vals - want_vals).abs().max().item(),
                "top_own_logprob_diff": (own - vals).abs().max().item(),
                "top_ordered": ordered,
                "top_ids_distinct": all(len(set(r)) == kk for r in ids.long().tolist()),
            }
        )
    return out


def rope_table(device: str) -> dict[str, Any]:
    """rope_store with each token's cos/sin against with the positions' table rows."""
    from engine import fused
    from engine.model import LlamaForCausalLM, TPGroup
    from engine.modelargs import parse

    a = parse(
        {
            "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 256,
            "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 256, "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        },
        Path("."),
    )  # fmt: skip
    model = LlamaForCausalLM(a, TPGroup(), torch.bfloat16, device=device)
    model.rotations(256)
    assert model.rotation is not None
    g = torch.Generator().manual_seed(3)
    positions = torch.tensor([0, 1, 77, 200, 255], device=device)
    n, d = positions.shape[0], a.head_dim
    q0 = torch.randn(n, 4, d, generator=g).to(device, torch.bfloat16)
    k0 = torch.randn(n, 2, d, generator=g).to(device, torch.bfloat16)
    v = torch.randn(n, 2, d, generator=g).to(device, torch.bfloat16)
    slots = torch.tensor([3, 4, 9, 12, 15], device=device)
    results = []
    for table in (False, True):
        q, k = q0.clone(), k0.clone()
        kc = torch.zeros(4, 4, 2, d, dtype=torch.bfloat16, device=device)
        vc = torch.zeros_like(kc)
        if table:
            cos, sin = model.rotation
            fused.rope_store(q, k, v, cos, sin, kc, vc, slots, positions)
        else:
            cos, sin = model._rotary(positions)
            fused.rope_store(q, k, v, cos, sin, kc, vc, slots)
        results.append((q.cpu(), kc.cpu(), vc.cpu()))
    (q1, kc1, vc1), (q2, kc2, vc2) = results
    return {
        "q_equal": torch.equal(q1, q2),
        "k_equal": torch.equal(kc1, kc2),
        "v_equal": torch.equal(vc1, vc2),
        "rotated": not torch.equal(q1, q0.cpu()),
    }


CHILD = textwrap.dedent(
    """
    import json, sys
    from tests.engine.test_sampling import compare, rope_table
    cases = [tuple(c) for c in json.loads(sys.argv[1])]
    print(json.dumps({"sampling": compare("cpu", cases), "rope": rope_table("cpu")}))
    """
)


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    if torch.cuda.is_available():
        return {"sampling": compare("cuda", CASES), "rope": rope_table("cuda")}
    return run_interpreted(CHILD, CASES)


def check(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        assert r["width"][0] == r["width"][1], r
        assert r["greedy_equal"], r
        assert r["greedy_logprob_diff"] < 1e-4, r
        assert r["top_values_diff"] < 1e-4, r
        assert r["top_own_logprob_diff"] < 1e-4, r
        assert r["top_ordered"] and r["top_ids_distinct"], r


@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_sampling_kernels_agree_with_the_eager_math(results: dict[str, Any], case: int) -> None:
    row = results["sampling"][case]
    assert row["shape"] == list(CASES[case][:3])
    check([row])


def test_rope_store_reads_each_positions_rotation_from_the_table(results: dict[str, Any]) -> None:
    r = results["rope"]
    assert r["rotated"], r
    assert r["q_equal"] and r["k_equal"] and r["v_equal"], r


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_llamas_vocabulary_at_128_rows() -> None:
    check(compare("cuda", [(128, 128256, K, "bfloat16", True), (1, 128256, K, "bfloat16", True)]))
