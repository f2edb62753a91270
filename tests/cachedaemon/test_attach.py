"""attach_model: a meta-device module gets views of the pool, or a clear error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from cachedaemon.client import assign, attach_model, attach_state_dict
from cachedaemon.config import make_config
from cachedaemon.errors import CacheError, CacheMismatch, DaemonUnavailable


def meta_module(
    shapes: dict[str, tuple[int, ...]], dtype: torch.dtype = torch.bfloat16
) -> torch.nn.Module:
    """A module tree on the meta device whose parameter names are the checkpoint's."""
    root = torch.nn.Module()
    for name, shape in shapes.items():
        owner = root
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        owner.register_parameter(
            leaf, torch.nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"))
        )
    return root


@pytest.fixture(scope="module")
def served(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, module_daemons: Any) -> Path:
    run = tmp_path_factory.mktemp("attach") / "run"
    module_daemons(tiny_model, run)
    return run / "daemon-0.sock"


def test_attach_model_replaces_every_parameter_with_pool_views(
    tiny_model: Path, served: Path
) -> None:
    full = load_file(tiny_model / "model.safetensors")
    module = meta_module({n: tuple(t.shape) for n, t in full.items()})
    report = attach_model(module, served, make_config(tiny_model))
    assert report.source == "daemon" and report.tensors == len(full)
    for name, param in module.named_parameters():
        assert not param.is_meta and not param.requires_grad
        assert torch.equal(param, full[name])


def test_assign_is_zero_copy_and_keeps_tied_weights_tied(tiny_model: Path, served: Path) -> None:
    state = attach_state_dict(served)
    module = meta_module({"model.embed_tokens.weight": (256, 64)})
    module.add_module("lm_head", torch.nn.Module())
    module.lm_head.weight = module.model.embed_tokens.weight  # tied, as tie_word_embeddings does
    assign(module, {"model.embed_tokens.weight": state["model.embed_tokens.weight"]})
    assert (
        module.model.embed_tokens.weight.data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    )
    assert module.lm_head.weight is module.model.embed_tokens.weight


def test_shape_or_dtype_differences_and_leftovers_are_errors(
    tiny_model: Path, served: Path
) -> None:
    full = load_file(tiny_model / "model.safetensors")
    wrong = meta_module({"model.norm.weight": (65,)})
    with pytest.raises(
        CacheError, match=r"model.norm.weight: the pool holds torch.bfloat16 \[64\]"
    ):
        attach_model(wrong, served)
    extra = meta_module(
        {**{n: tuple(t.shape) for n, t in full.items()}, "model.extra.weight": (3,)}
    )
    with pytest.raises(CacheError, match=r"still on the meta device.*model.extra.weight"):
        attach_model(extra, served)


def test_mismatch_lists_fields_and_falls_back_to_disk_when_allowed(
    tiny_model: Path, served: Path
) -> None:
    full = load_file(tiny_model / "model.safetensors")
    want = make_config(tiny_model, dtype="float16")
    module = meta_module({n: tuple(t.shape) for n, t in full.items()}, torch.float16)
    with pytest.raises(CacheMismatch, match="fields that differ: dtype") as info:
        attach_model(module, served, want)
    assert info.value.fields == ["dtype"]
    report = attach_model(module, served, want, model_dir=tiny_model, fallback=True)
    assert report.source == "disk" and "dtype" in report.fallback_reason
    assert torch.equal(module.model.norm.weight, full["model.norm.weight"].half())


def test_missing_daemon_names_the_socket(tiny_model: Path, tmp_path: Path) -> None:
    full = load_file(tiny_model / "model.safetensors")
    module = meta_module({n: tuple(t.shape) for n, t in full.items()})
    sock = tmp_path / "nobody.sock"
    with pytest.raises(DaemonUnavailable, match=str(sock)):
        attach_model(module, sock)
    report = attach_model(module, sock, model_dir=tiny_model, fallback=True)
    assert report.source == "disk"
