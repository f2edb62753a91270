"""Putting a pool's tensors into a model vLLM built: torch only, no vLLM import.

vLLM allocates every weight with `torch.empty` inside its layers' constructors; under
`WeightsOnMeta` those land on the meta device (no memory), while what the constructors
compute (rotary caches, attention scales, norms' ones) is made for real as usual.

`place` then gives each parameter whose name, shape and dtype the pool holds a view of the
pool (zero copy, read-only); every other parameter is made real and empty, for the model's
own `load_weights` to fill from the pool tensors left over (vLLM's fused `qkv_proj` and
`gate_up_proj` are filled from the checkpoint's `q_proj`, `k_proj`, ... that way). Buffers
are never views: vLLM writes some of them after loading (attention `_k_scale`, ...), and a
write to a read-only mapping kills the process, so a buffer the pool holds gets a copy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import msgspec
import torch
from torch.overrides import TorchFunctionMode

from holdfast_vllm.errors import PluginError


class WeightsOnMeta(TorchFunctionMode):
    """`torch.empty` (how vLLM allocates weights) makes meta tensors; nothing else changes."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Iterable[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.empty:
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


class Placement(msgspec.Struct, frozen=True):
    shared: tuple[str, ...]  # parameters that are views of the pool
    private: tuple[str, ...]  # parameters made real and empty, to be loaded
    rest: tuple[str, ...]  # pool tensors no parameter took as they are
    shared_bytes: int
    private_bytes: int


def like(param: torch.nn.Parameter, data: torch.Tensor) -> torch.nn.Parameter:
    """A parameter of param's class and attributes (vLLM's weight_loader, output_dim, ...)
    over `data`."""
    new: torch.nn.Parameter = torch.nn.Parameter.__new__(type(param), data, requires_grad=False)
    new.__dict__.update(param.__dict__)
    return new


def place(
    model: torch.nn.Module,
    pool: dict[str, torch.Tensor],
    *,
    zero_copy: bool,
    device: torch.device,
) -> Placement:
    """Give every parameter and buffer of `model` its tensor (see the module's docstring)."""
    shared: list[str] = []
    private: list[str] = []
    taken: set[str] = set()
    done: dict[int, torch.nn.Parameter] = {}  # id of a replaced parameter -> its new one (ties)
    for prefix, module in model.named_modules():  # deduplicated: a tied lm_head is skipped
        for leaf, param in list(module._parameters.items()):
            if param is None:
                continue
            name = f"{prefix}.{leaf}" if prefix else leaf
            if id(param) in done:
                module._parameters[leaf] = done[id(param)]
                continue
            src = pool.get(name)
            if zero_copy and src is not None and _fits(src, param, device):
                new = like(param, src)
                shared.append(name)
                taken.add(name)
            elif param.is_meta:
                new = like(param, torch.empty(param.shape, dtype=param.dtype, device=device))
                private.append(name)
            else:  # small and made by the constructor (a norm's ones): loaded over
                new = param
                private.append(name)
            done[id(param)] = new
            module._parameters[leaf] = new
        for leaf, buf in list(module._buffers.items()):
            name = f"{prefix}.{leaf}" if prefix else leaf
            if buf is not None and name in pool:
                module._buffers[leaf] = pool[name].to(device=device, dtype=buf.dtype, copy=True)
                taken.add(name)
    params = dict(model.named_parameters())
    return Placement(
        shared=tuple(shared),
        private=tuple(private),
        rest=tuple(n for n in pool if n not in taken),
        shared_bytes=sum(params[n].nbytes for n in shared if n in params),
        private_bytes=sum(params[n].nbytes for n in private if n in params),
    )


def _fits(src: torch.Tensor, param: torch.Tensor, device: torch.device) -> bool:
    return src.shape == param.shape and src.dtype == param.dtype and src.device == device


def outside(model: torch.nn.Module, spans: Iterable[tuple[int, int]]) -> dict[str, int]:
    """The bytes of each parameter of `model` whose data lies outside every (address,
    size) span of the pool's mappings: the engine's private weight memory."""
    ranges = list(spans)
    return {
        name: p.nbytes
        for name, p in model.named_parameters()
        if p.nbytes and not any(a <= p.data_ptr() < a + n for a, n in ranges)
    }


def left_on_meta(model: torch.nn.Module) -> list[str]:
    return [
        n
        for n, t in [
            *model.named_parameters(remove_duplicate=False),
            *model.named_buffers(remove_duplicate=False),
        ]
        if t.is_meta
    ]


def check_loaded(placement: Placement, loaded: set[str] | None, model: torch.nn.Module) -> None:
    """PluginError when a parameter made real for loading got no tensor, or meta is left."""
    if loaded is not None:
        missing = sorted(set(placement.private) - loaded)
        if missing:
            raise PluginError(
                f"{len(missing)} parameters got no tensor from the pool (first: {missing[:3]}); "
                "the daemon serves another checkpoint layout than vLLM's model expects: "
                "serve the checkpoint passed as --model"
            )
    left = left_on_meta(model)
    if left:
        raise PluginError(
            f"{len(left)} tensors still on the meta device after loading (first: {left[:3]})"
        )
