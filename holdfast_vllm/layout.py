"""A pool in vLLM's layout (`cachedaemon serve --layout vllm`): vLLM's model and loaders
make it, the daemon reads the checkpoint.

Nothing here lists an architecture. vLLM builds its own model for the checkpoint
(`initialize_model`, its weights on meta) under a tensor-parallel group of this one
process that says `tp_size` ranks and this rank (vLLM's linear layers read both at
construction, and their weight loaders shard by them); each parameter then becomes a
writable view of the pool being built; the model's own `load_weights` fills them from
holdfast's checkpoint reader (the daemon's reads and dtype conversion, as for a reference
pool); `process_weights_after_loading` runs, with vLLM's CPU GEMM packing left out
(`shared_gemm`). The manifest then lists the model's named parameters, fused `qkv_proj`
and `gate_up_proj` included, so that an engine places every weight as a view.

Refused, naming what to change: an architecture vLLM does not know, a checkpoint vLLM
would quantize, a parameter no checkpoint tensor filled, and one that post-processing
replaced by a tensor of another shape or storage.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import structlog
import torch
from vllm.config import (
    DeviceConfig,
    LoadConfig,
    ModelConfig,
    ParallelConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed import parallel_state
from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
from vllm.utils.torch_utils import set_default_torch_dtype

from cachedaemon import layouts
from cachedaemon.backends import Backend, OwnedChunk
from cachedaemon.checkpoint import CheckpointReader
from cachedaemon.config import LoadOptions
from cachedaemon.digest import Digester, FileDigest
from cachedaemon.loader import OutSpec, plan, produce
from cachedaemon.manifest import TensorEntry
from cachedaemon.pool import Pool, sealed
from cachedaemon.pool_plan import layout
from cachedaemon.progress import ByteProgress
from cachedaemon.strides import contiguous_stride
from holdfast_vllm import check_version, placement
from holdfast_vllm.errors import LayoutError, PluginError

log = structlog.get_logger("holdfast_vllm.layout")


def build_pool(
    model_dir: str | Path,
    opts: LoadOptions,
    backend: Backend,
    fingerprint: str,
    progress: ByteProgress | None = None,
) -> tuple[Pool, int]:
    """A sealed pool of the parameters vLLM's model holds for this rank, and the bytes read
    from the checkpoint (cachedaemon.pool.build_pool's contract, in vLLM's layout)."""
    try:
        check_version()
    except PluginError as e:
        raise LayoutError(str(e)) from e
    config = vllm_config(model_dir, opts)
    device = torch.device(opts.device)
    with set_current_vllm_config(config), tensor_parallel(opts.tp_size, opts.tp_rank):
        model = meta_model(config, device)
        params = parameters(model)
        specs = [OutSpec(n, str(p.dtype).removeprefix("torch."), tuple(p.shape)) for n, p in params]
        places, used = layout(specs, backend)
        chunks: list[OwnedChunk] = []
        try:
            chunks = [backend.create(u) for u in used]
            regions = bind(model, params, chunks, places, device)
            bytes_read, files = fill(model, config, model_dir, opts, progress)
            check_views(model, regions)
            sums = backend.checksums([regions[n] for n, _ in params])
        except BaseException:
            for c in chunks:
                c.close()
            raise
    pool = sealed(
        chunks, used, backend, fingerprint, opts.device, entries(specs, places, sums), files
    )
    log.info("vllm layout built", parameters=len(specs), pool_bytes=pool.manifest.pool_bytes)
    return pool, bytes_read


def entries(
    specs: list[OutSpec], places: list[tuple[int, int, int]], sums: list[str]
) -> tuple[TensorEntry, ...]:
    """The manifest's entry of each parameter: its place, dtype, shape and checksum."""
    return tuple(
        TensorEntry(s.name, chunk, offset, s.dtype, s.shape, contiguous_stride(s.shape), n, sum_)
        for s, (chunk, offset, n), sum_ in zip(specs, places, sums, strict=True)
    )


def vllm_config(model_dir: str | Path, opts: LoadOptions) -> VllmConfig:
    """The smallest VllmConfig that makes vLLM's model for this checkpoint and rank."""
    try:
        model_config = ModelConfig(model=str(model_dir), dtype=opts.dtype, skip_tokenizer_init=True)
    except Exception as e:  # vLLM raises ValueError, pydantic's errors, transformers' ...
        raise LayoutError(
            f"vLLM cannot make a model config of {model_dir} ({e}); serve it with --layout "
            "reference, or a checkpoint this vLLM supports"
        ) from e
    if model_config.quantization is not None:
        raise LayoutError(
            f"{model_dir} is quantized ({model_config.quantization}); --layout vllm holds "
            "unquantized parameters only: use --layout reference, or an unquantized checkpoint"
        )
    return VllmConfig(
        model_config=model_config,
        parallel_config=ParallelConfig(tensor_parallel_size=opts.tp_size),
        device_config=DeviceConfig(torch.device(opts.device).type),
        load_config=LoadConfig(),
    )


@contextlib.contextmanager
def tensor_parallel(size: int, rank: int) -> Iterator[None]:
    """vLLM's distributed state for this one process (gloo, world size 1), its tensor-
    parallel group then saying `size` ranks and this `rank`: what vLLM's layers read when
    they are made and when their weight loaders shard. Nothing is communicated: making a
    model and loading its weights send nothing between ranks."""
    with tempfile.TemporaryDirectory(prefix="holdfast-vllm-tp-") as tmp:
        parallel_state.init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"file://{tmp}/init",
            backend="gloo",
        )
        try:
            parallel_state.initialize_model_parallel(1, 1)
            group = parallel_state.get_tp_group()
            group.world_size, group.rank_in_group = size, rank
            yield
        finally:
            parallel_state.destroy_model_parallel()
            parallel_state.destroy_distributed_environment()


def meta_model(config: VllmConfig, device: torch.device) -> torch.nn.Module:
    """vLLM's model for `config`, its weights on meta; LayoutError for an architecture
    this vLLM does not know."""
    model_config = config.model_config
    try:
        with set_default_torch_dtype(model_config.dtype), device, placement.WeightsOnMeta():
            model: torch.nn.Module = initialize_model(vllm_config=config, model_config=model_config)
    except ValueError as e:
        raise LayoutError(
            f"vLLM cannot make the model of {model_config.model} ({e}); serve it with "
            "--layout reference"
        ) from e
    return model


def parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The model's parameters, each once (a tied one under its first name)."""
    return list(model.named_parameters())


def bind(
    model: torch.nn.Module,
    params: list[tuple[str, torch.nn.Parameter]],
    chunks: list[OwnedChunk],
    places: list[tuple[int, int, int]],
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """Make every parameter of `model` a writable view of its place in the pool (what the
    constructor computed, a norm's ones, is kept); the flat uint8 region of each."""
    pool: dict[str, torch.Tensor] = {}
    regions: dict[str, torch.Tensor] = {}
    for (name, param), (chunk, offset, nbytes) in zip(params, places, strict=True):
        region = chunks[chunk].tensor[offset : offset + nbytes]
        view = region.view(param.dtype).view(param.shape)
        if not param.is_meta:
            view.copy_(param.detach())
        pool[name], regions[name] = view, region
    placed = placement.place(model, pool, zero_copy=True, device=device)
    if placed.private:  # every parameter has its own place: none is left to load
        raise LayoutError(f"parameters without a place in the pool: {list(placed.private)[:3]}")
    return regions


def fill(
    model: torch.nn.Module,
    config: VllmConfig,
    model_dir: str | Path,
    opts: LoadOptions,
    progress: ByteProgress | None,
) -> tuple[int, tuple[FileDigest, ...]]:
    """The model's `load_weights` fed from holdfast's checkpoint reader (whole tensors in
    opts.dtype: vLLM's weight loaders take this rank's part), then its post-processing.
    Returns the bytes read and the digest of the checkpoint's files, taken as read."""
    whole = LoadOptions(dtype=opts.dtype)
    load: Callable[..., Any] = getattr(model, "load_weights")  # noqa: B009  # vLLM models have it
    with CheckpointReader(model_dir) as reader:
        plans = plan(reader, whole)
        if progress is not None:
            progress.set_total(reader.total_bytes)
        on_bytes = progress.advance if progress is not None else None
        digester = Digester(reader.model_dir / "config.json", reader.files, reader.tensors.values())
        reader.on_read = digester.add  # the checkpoint's content digest, as any pool's
        try:
            tensors = ((s.name, t) for s, t in produce(reader, plans, whole, on_bytes))
            with torch.no_grad():
                loaded = load(tensors)
            files = digester.result()
        except BaseException:
            digester.close()
            raise
        bytes_read: int = reader.bytes_read
    missing = sorted({n for n, _ in model.named_parameters()} - set(loaded or ()))
    if loaded is not None and missing:
        raise LayoutError(
            f"{len(missing)} of vLLM's parameters got no tensor from {model_dir} (first: "
            f"{missing[:3]}); the checkpoint lacks what vLLM's model needs: serve a complete "
            "checkpoint, or use --layout reference"
        )
    with shared_gemm():
        process_weights_after_loading(model, config.model_config, torch.device(opts.device))
    return bytes_read, files


def check_views(model: torch.nn.Module, regions: dict[str, torch.Tensor]) -> None:
    """Every parameter after post-processing is still a view of its place in the pool
    (or, tied, of another's); LayoutError names one that was replaced."""
    places = {(r.data_ptr(), r.nbytes) for r in regions.values()}
    for name, p in model.named_parameters(remove_duplicate=False):
        if (p.data_ptr(), p.nbytes) not in places:
            raise LayoutError(
                f"vLLM's process_weights_after_loading replaced {name} (now {p.dtype}, shape "
                f"{tuple(p.shape)}) by a tensor outside the pool: this model's post-"
                "processing cannot be shared; serve it with --layout reference"
            )


@contextlib.contextmanager
def shared_gemm() -> Iterator[None]:
    """Post-processing without vLLM's CPU GEMM packing: on a CPU platform vLLM hands each
    linear layer's weight to oneDNN (or sgl) to repack into a private buffer and empties
    the parameter, which a pool's view must not be; here each layer gets vLLM's own
    fallback instead, `torch.nn.functional.linear` over the weight as it is. Other
    platforms never call the packer; nothing changes there."""
    from vllm.model_executor.layers import utils

    packer = utils.dispatch_cpu_unquantized_gemm

    def plain(layer: torch.nn.Module, remove_weight: bool) -> None:
        layer.cpu_linear = torch.nn.functional.linear  # type: ignore[assignment]

    utils.dispatch_cpu_unquantized_gemm = plain
    try:
        yield
    finally:
        utils.dispatch_cpu_unquantized_gemm = packer


def mismatch(sock: str, wanted: str) -> str:
    """What to change when the daemon on `sock` serves another layout than `wanted`."""
    from cachedaemon import protocol
    from cachedaemon.errors import CacheError
    from holdfast_contract.errors import ProtocolError

    try:
        reply, _ = protocol.call(sock, protocol.StatusRequest())
    except (CacheError, ProtocolError, OSError):
        reply = None
    pool = reply.config.layout if isinstance(reply, protocol.StatusReply) else "another"
    if layouts.kind(wanted) == "reference":
        fix = (
            'start the daemon with --layout reference, or set "layout": "vllm" in '
            "--model-loader-extra-config"
        )
    elif layouts.kind(pool) == "vllm":
        fix = "start the daemon with the python of this engine's vLLM (--layout vllm)"
    else:
        fix = (
            "start the daemon with --layout vllm (with the python of this engine's vLLM), or "
            'set "layout": "reference" in --model-loader-extra-config (vLLM\'s fused '
            "parameters then private copies)"
        )
    return f"layout: pool is {pool}, engine wants {wanted}: {fix} (daemon {sock})"
