"""Hugging Face transformers models, built to be attached: parameters on meta, buffers real.

    model = empty_model("/models/llama", torch.bfloat16)    # no memory for weights
    attach_model(model, "/run/daemon-0.sock", make_config("/models/llama", dtype="bfloat16"))

Non-persistent buffers (rotary frequencies, position ids, token type ids) are in no
checkpoint; here they are computed by the model's own constructor, for real. A model built
entirely under `torch.device("meta")` works too: `attach_model` fills such buffers from the
model's own init (`fill_buffers`). Needs the `hf` extra (transformers).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cachedaemon.errors import CacheError


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Every nn.Parameter registered inside lands on meta; buffers stay real."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:  # a tied (shared) one is already meta
            param = nn.Parameter(param.to("meta"), requires_grad=False)
        original(module, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def model_class(config: Any) -> tuple[Any, str]:
    """The transformers class of config.json's architecture, and "generate" for a causal
    LM or "embed" for anything else (AutoModel when no architecture is named)."""
    import transformers

    archs = list(getattr(config, "architectures", None) or [])
    for arch in archs:
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls, "generate" if arch.endswith("ForCausalLM") else "embed"
    if archs:
        raise CacheError(
            f"config.json architectures={archs} are not in transformers "
            f"{transformers.__version__}; upgrade transformers"
        )
    return transformers.AutoModel, "embed"


def empty_model(
    model_dir: str | Path, dtype: torch.dtype, device: str | torch.device = "cpu"
) -> nn.Module:
    """The checkpoint's transformers model in eval mode: parameters on meta (to attach),
    buffers computed on `device`, tied weights tied."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir))
    cls, _ = model_class(config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with params_on_meta(), torch.device(device):
            module: nn.Module = (
                cls.from_config(config) if hasattr(cls, "from_config") else cls(config)
            )
    finally:
        torch.set_default_dtype(previous)
    tie_weights = getattr(module, "tie_weights", None)
    if callable(tie_weights):
        tie_weights()  # tied weights share one meta tensor: one checkpoint entry fills both
    return module.eval()


def _init_owner(root: nn.Module, name: str) -> Any:
    """The `_init_weights` of the nearest transformers model above `name`, or None."""
    parts = name.split(".")
    for i in range(len(parts), -1, -1):
        owner = root.get_submodule(".".join(parts[:i]))
        init = getattr(owner, "_init_weights", None)
        if callable(init):
            return init
    return None


def fill_buffers(root: nn.Module, device: torch.device) -> list[str]:
    """Non-persistent buffers still on meta, made real on `device`. The names it filled.

    A transformers model's come from a twin built the way `empty_model` builds one (its
    constructor computes them, in every transformers release); what the twin lacks, from
    the model's own init (transformers' `_init_weights`, which computes them in 5.x). That
    init writes only into what was not attached: while it runs, the module's parameters are
    meta stand-ins and its attached buffers private copies (transformers 5 `copy_`s into
    every buffer of a module, such as BERT's `position_ids`, which an old checkpoint holds);
    the pool's views are put back untouched afterwards.
    """
    filled = _from_twin(root, device)
    for name, module in root.named_modules():
        missing = [
            leaf
            for leaf, buf in module._buffers.items()
            if buf is not None and buf.is_meta and leaf in module._non_persistent_buffers_set
        ]
        init = _init_owner(root, name) if missing else None
        if init is None:
            continue
        _run_init(init, module, missing, device)
        filled += [f"{name}.{leaf}" if name else leaf for leaf in missing]
    return filled


def _from_twin(root: nn.Module, device: torch.device) -> list[str]:
    """Meta non-persistent buffers of a transformers model, copied from a twin whose
    constructor ran with parameters on meta and buffers on `device`."""
    missing = {
        f"{name}.{leaf}" if name else leaf: buf
        for name, module in root.named_modules()
        for leaf, buf in module._buffers.items()
        if buf is not None and buf.is_meta and leaf in module._non_persistent_buffers_set
    }
    config = getattr(root, "config", None)
    if not missing or config is None or not hasattr(type(root), "config_class"):
        return []
    with params_on_meta(), torch.device(device):
        twin = type(root)(config)
    filled = []
    for name, buf in missing.items():
        try:
            made = twin.get_buffer(name)
        except AttributeError:
            continue
        if made.is_meta or made.shape != buf.shape:
            continue
        owner_name, _, leaf = name.rpartition(".")
        root.get_submodule(owner_name)._buffers[leaf] = made.to(buf.dtype)
        filled.append(name)
    return filled


def _run_init(init: Any, module: nn.Module, missing: list[str], device: torch.device) -> None:
    """`init(module)` with the `missing` buffers real and nothing attached reachable."""
    params, buffers = module._parameters, module._buffers
    module._parameters = {
        k: None if v is None else nn.Parameter(v.to("meta"), requires_grad=False)
        for k, v in params.items()
    }
    module._buffers = {
        k: None if v is None else _private(v, k in missing, device) for k, v in buffers.items()
    }
    try:
        with torch.no_grad():
            init(module)
        computed = {k: module._buffers[k] for k in missing}
    finally:
        module._parameters, module._buffers = params, buffers
    buffers.update(computed)


def _private(buf: torch.Tensor, missing: bool, device: torch.device) -> torch.Tensor:
    """What the init sees of one buffer: zeros to fill, or a copy of an attached one."""
    if missing:
        return torch.zeros(buf.shape, dtype=buf.dtype, device=device)
    return buf.clone()
