"""`--load-format holdfast`: vLLM's model, its weights attached from this rank's cache daemon.

The model is built with its weights on meta (`placement.WeightsOnMeta`); the daemon's pool
is mapped (`cachedaemon.client.attach`, checked against the CacheConfig of --model's files
as stat sees them, dtype, TP rank and device: no tensor data is read; `verify: content`
also accepts a byte-identical copy after digesting it); `placement.place` hands each
parameter its tensor; then `process_weights_after_loading` runs as in vLLM's own loaders.
When no daemon answers or the configs differ, `fallback: true` loads from disk with vLLM's
default loader (the differing fields and files are logged), `fallback: false` stops with
an error that names them, printed again as the run's last line so that it is not lost in
vLLM's traceback (`holdfast_vllm.refusal`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any

import structlog
import torch
from vllm.config import ModelConfig, VllmConfig
from vllm.config.load import LoadConfig
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
from vllm.utils.torch_utils import set_default_torch_dtype

from cachedaemon.client import Attached, attach
from cachedaemon.errors import CacheError, CacheMismatch, DaemonUnavailable
from holdfast_vllm import check_version, identity, layout, placement
from holdfast_vllm.core_fork import engine_core_start
from holdfast_vllm.errors import PluginError
from holdfast_vllm.options import LoaderOptions, parse

log = structlog.get_logger("holdfast_vllm.loader")


class HoldfastModelLoader(BaseModelLoader):  # type: ignore[misc]  # vLLM is untyped here
    """Attaches the weights a holdfast cache daemon holds; see the module's docstring."""

    def __init__(self, load_config: LoadConfig) -> None:
        check_version()
        super().__init__(load_config)
        self.options: LoaderOptions = parse(load_config.model_loader_extra_config)
        self._attached: Attached | None = None  # keeps the pool mapped while the model lives

    def download_model(self, model_config: ModelConfig) -> None:
        self._disk_loader().download_model(model_config)

    def load_weights(self, model: torch.nn.Module, model_config: ModelConfig) -> None:
        """In-place reload of a model vLLM already holds: copies from the pool."""
        attached = self._attach(model_config, _device(model))
        _model_loader(model)(iter(attached.tensors.items()))

    def load_model(
        self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = ""
    ) -> torch.nn.Module:
        device = _target_device(vllm_config, self.load_config)
        t0 = time.perf_counter()
        try:
            attached = self._attach(model_config, device)
        except (DaemonUnavailable, CacheMismatch) as e:
            return self._fall_back(vllm_config, model_config, prefix, e)
        with set_default_torch_dtype(model_config.dtype):
            with torch.device(device), placement.WeightsOnMeta():
                model: torch.nn.Module = initialize_model(
                    vllm_config=vllm_config, model_config=model_config, prefix=prefix
                )
            zero_copy = self.options.mode == "zero_copy"
            placed = placement.place(model, attached.tensors, zero_copy=zero_copy, device=device)
            rest = [(n, attached.tensors[n]) for n in placed.rest]
            loaded = _model_loader(model)(iter(rest)) if rest else set()
            placement.check_loaded(placed, _with_shared(loaded, placed), model)
            with layout.shared_gemm() if zero_copy else contextlib.nullcontext():
                process_weights_after_loading(model, model_config, device)
        self._attached = attached
        private = placement.outside(
            model, [(m.tensor.data_ptr(), m.size) for m in attached.mappings]
        )
        log.info(
            "weights attached",
            mode=self.options.mode,
            layout=self.options.layout,
            shared=len(placed.shared),
            shared_mb=round(placed.shared_bytes / 2**20, 1),
            loaded_from_pool=len(placed.private),
            private_mb=round(sum(private.values()) / 2**20, 1),
            private_bytes=sum(private.values()),
            private_weights=sorted(private)[:3],
            ms=round((time.perf_counter() - t0) * 1e3, 1),
            engine_core=engine_core_start(),
        )
        return model.eval()

    def _attach(self, model_config: ModelConfig, device: torch.device) -> Attached:
        rank = get_tensor_model_parallel_rank()
        world = get_tensor_model_parallel_world_size()
        sock = self.options.socket_for(rank, world)
        config = identity.cache_config(
            model_config.model,
            model_config.dtype,
            rank,
            world,
            device,
            layout=self.options.layout,
        )
        try:
            return attach(
                sock,
                config,
                timeout=self.options.timeout_s,
                model_dir=model_config.model,
                verify=self.options.verify,
            )
        except CacheMismatch as e:
            if self.options.fallback:
                raise
            if "layout" in e.fields:
                raise refusal(layout.mismatch(sock, config.layout)) from e
            raise refusal(f"{e}; {_hint(e, model_config)}") from e
        except DaemonUnavailable as e:
            if self.options.fallback:
                raise
            raise refusal(
                f"no cache daemon answers on {sock} ({e}); start `cachedaemon serve` for TP "
                f'rank {rank} there, fix "sockets", or set "fallback": true'
            ) from e
        except CacheError as e:
            raise refusal(f"attach from {sock}: {e}") from e

    def _fall_back(
        self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str, why: CacheError
    ) -> torch.nn.Module:
        fields = why.fields if isinstance(why, CacheMismatch) else []
        log.warning("attach failed; loading from disk", reason=str(why), fields=fields)
        model: torch.nn.Module = self._disk_loader().load_model(
            vllm_config=vllm_config, model_config=model_config, prefix=prefix
        )
        return model

    def _disk_loader(self) -> Any:
        plain = dataclasses.replace(
            self.load_config, load_format="auto", model_loader_extra_config={}
        )
        return DefaultModelLoader(plain)


def _hint(e: CacheMismatch, model_config: ModelConfig) -> str:
    """What to change, in vLLM's and this plugin's terms."""
    if set(e.fields) - {"checkpoint"}:
        return (
            f"serve --model {model_config.model} with --dtype "
            f'{identity.dtype_name(model_config.dtype)}, or set "fallback": true'
        )
    if e.stat_only:
        return 'if verify finds the same content, set "verify": "content"; or "fallback": true'
    return f'serve --model {model_config.model} on that daemon, or set "fallback": true'


def refusal(message: str) -> PluginError:
    """The error that ends the load. vLLM prints its traceback of the EngineCore's
    failure after it, so it is also printed again as the run's last line
    (`holdfast_vllm.refusal`): the one that says what to change."""
    log.error("holdfast refused the attach", reason=message)
    from holdfast_vllm import refusal as last_line

    last_line.record(message)
    return PluginError(message)


def _model_loader(model: torch.nn.Module) -> Any:
    """The model's own `load_weights` (checkpoint names -> vLLM's fused parameters)."""
    return getattr(model, "load_weights")  # noqa: B009  # vLLM models, not nn.Module, have it


def _with_shared(loaded: Any, placed: placement.Placement) -> set[str] | None:
    return None if loaded is None else {*loaded, *placed.shared}


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _target_device(vllm_config: VllmConfig, load_config: LoadConfig) -> torch.device:
    device = vllm_config.device_config.device if load_config.device is None else load_config.device
    target = torch.device(device)
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    return target
