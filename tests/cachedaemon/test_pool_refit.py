"""A refit maps another pool of the same layout at the addresses of the one attached: every
view reads the new weights, no pointer changes, and a pool of other shapes is refused
before anything changes."""

from __future__ import annotations

import concurrent.futures
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from cachedaemon import refit
from cachedaemon.checkpoint_gen import make_checkpoint
from cachedaemon.client import attach_model
from cachedaemon.config import make_config
from cachedaemon.errors import CacheError
from tests.cachedaemon.test_attach import meta_module


def _module(model: Path) -> torch.nn.Module:
    full = load_file(model / "model.safetensors")
    return meta_module({n: tuple(t.shape) for n, t in full.items()})


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(module.named_parameters())


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory, module_daemons: Any) -> tuple[Path, Path]:
    """Daemons serving two checkpoints of one shape and other weights (seeds 0 and 1)."""
    root = tmp_path_factory.mktemp("refit")
    a = make_checkpoint(root / "a", "tiny", seed=0)
    b = make_checkpoint(root / "b", "tiny", seed=1)
    module_daemons(a, root / "run-a")
    module_daemons(b, root / "run-b")
    return root / "run-a" / "daemon-0.sock", root / "run-b" / "daemon-0.sock"


def test_a_refit_swaps_every_tensor_in_place(tmp_path: Path, two: tuple[Path, Path]) -> None:
    sock_a, sock_b = two
    a, b = sock_a.parent.parent / "a", sock_b.parent.parent / "b"
    module = _module(a)
    attach_model(module, sock_a, make_config(a))
    before = {n: (t.data_ptr(), t.clone()) for n, t in _state(module).items()}
    new = load_file(b / "model.safetensors")
    assert any(not torch.equal(before[n][1], new[n]) for n in new)  # the seeds differ

    r = refit.fetch(sock_b, make_config(b), _state(module))
    assert all(torch.equal(t, before[n][1]) for n, t in _state(module).items())  # not yet
    old = set(r.inodes)
    assert old and 0 not in old and old <= held_inodes()
    r.swap()
    assert r.fds == [] and r.swap_ms > 0
    for name, t in _state(module).items():
        assert t.data_ptr() == before[name][0]
        assert torch.equal(t, new[name]), name
    # nothing of this process holds the old pool now: no mapping, no fd (Python's mmap
    # keeps a duplicate of the fd it mapped; it names the new memfd now)
    assert not old & held_inodes()


def held_inodes() -> set[int]:
    """The inodes of the memfds this process maps or holds an fd on."""
    found = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 6 and parts[5].startswith("/memfd:"):
            found.add(int(parts[4]))
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("/memfd:"):
                found.add(os.stat(f"/proc/self/fd/{name}").st_ino)
        except OSError:
            continue
    return found


def test_a_pool_of_other_shapes_is_refused_before_anything_changes(
    tmp_path: Path, two: tuple[Path, Path], module_daemons: Any
) -> None:
    sock_a, _ = two
    a = sock_a.parent.parent / "a"
    other = make_checkpoint(tmp_path / "wide", "tiny", seed=2)
    cfg = json.loads((other / "config.json").read_text())
    full = load_file(other / "model.safetensors")
    from safetensors.torch import save_file

    name = "model.norm.weight"
    full[name] = torch.ones(full[name].shape[0] * 2, dtype=full[name].dtype)
    save_file(full, str(other / "model.safetensors"), metadata={"format": "pt"})
    (other / "config.json").write_text(json.dumps(cfg))
    module_daemons(other, tmp_path / "run")
    module = _module(a)
    attach_model(module, sock_a, make_config(a))
    before = {n: t.clone() for n, t in _state(module).items()}
    with pytest.raises(CacheError, match=name):
        refit.fetch(tmp_path / "run" / "daemon-0.sock", None, _state(module))
    assert all(torch.equal(t, before[n]) for n, t in _state(module).items())


def test_nothing_answering_is_a_clear_error(tmp_path: Path, two: tuple[Path, Path]) -> None:
    sock_a, _ = two
    a = sock_a.parent.parent / "a"
    module = _module(a)
    attach_model(module, sock_a, make_config(a))
    with pytest.raises(CacheError, match="nothing answers"):
        refit.fetch(tmp_path / "none.sock", None, _state(module))


@pytest.mark.gpu
def test_on_the_gpu_a_captured_graph_replays_the_new_weights(
    tmp_path: Path, tiny_model: Path, next_model: Path, start_daemon: Any
) -> None:
    """cuda-vmm pools: the new allocation is mapped into the old one's reserved range, so a
    CUDA graph captured over the old weights reads the new ones, at the same pointers."""
    start_daemon(tiny_model, tmp_path / "a", "--device", "cuda:0")
    start_daemon(next_model, tmp_path / "b", "--device", "cuda:0")
    module = _module(tiny_model)
    attach_model(module, tmp_path / "a" / "daemon-0.sock", make_config(tiny_model, device="cuda:0"))
    state = _state(module)
    name = "model.embed_tokens.weight"
    w = state[name]
    ptrs = {n: t.data_ptr() for n, t in state.items()}
    out = torch.zeros((), device="cuda:0", dtype=torch.float32)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        out.copy_(w.float().sum())  # warm the kernels outside the capture
        with torch.cuda.graph(graph, stream=side):
            out.copy_(w.float().sum())
    graph.replay()
    torch.cuda.synchronize()
    old = out.item()
    new = load_file(next_model / "model.safetensors")
    expected = new[name].to("cuda:0", w.dtype).float().sum().item()
    assert abs(old - expected) > 1e-3

    # fetched on a thread of its own, as the engine does (no CUDA context there yet)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        r = pool.submit(refit.fetch, tmp_path / "b" / "daemon-0.sock", None, state).result()
    r.swap()
    graph.replay()
    torch.cuda.synchronize()
    assert out.item() == pytest.approx(expected, rel=1e-5, abs=1e-3)
    for n, t in _state(module).items():
        assert t.data_ptr() == ptrs[n]
        assert torch.equal(t.cpu(), new[n].to(t.dtype)), n
