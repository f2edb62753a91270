"""The one-row kernel (engine/gemv.py) computes F.linear's product, eagerly and replayed from
a CUDA graph, at every tiling the bench tries; shapes it does not fit go to F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import gemv

pytestmark = pytest.mark.gpu

SHAPES = [(4096, 4096), (1024, 4096), (6144, 4096), (4096, 14336), (1000, 512), (3, 256)]


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_the_kernel_is_the_product(n: int, k: int) -> None:
    torch.manual_seed(n + k)
    w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
    x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
    want = F.linear(x.float(), w.float())
    for t in [gemv.tiling(n, k), gemv.Tiling(4, 256, 4, 2), gemv.Tiling(32, 256, 8, 4)]:
        got = gemv.gemv(x, w, t)
        assert got.shape == (1, n) and got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)


def test_a_graph_replays_the_kernel_on_new_inputs() -> None:
    w = torch.randn(2048, 1024, dtype=torch.bfloat16, device="cuda") * 0.02
    x = torch.randn(1, 1024, dtype=torch.bfloat16, device="cuda")
    gemv.gemv(x, w)  # compiled outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = gemv.gemv(x, w)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.testing.assert_close(y.float(), F.linear(x.float(), w.float()), rtol=1e-2, atol=1e-2)


def test_linear_takes_the_kernel_only_where_enabled_and_fitting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    w = torch.randn(512, 512, dtype=torch.bfloat16, device="cuda")
    one, two = w[:1].clone(), w[:2].clone()
    assert gemv.fits(one, w) and not gemv.fits(two, w)
    assert not gemv.fits(one[:, :500], w[:, :500])  # k not a multiple of 256
    assert not gemv.fits(one.float(), w)
    assert not gemv.fits(one.cpu(), w.cpu())
    monkeypatch.setattr(gemv, "enabled", True)
    for x in (one, two):
        torch.testing.assert_close(
            gemv.linear(x, w).float(), F.linear(x.float(), w.float()), rtol=1e-2, atol=0.5
        )
