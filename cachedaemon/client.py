"""Engine side: attach to a daemon's pool, zero-copy and read-only, or fall back to disk."""

from __future__ import annotations

import time
from collections.abc import Collection
from pathlib import Path

import msgspec
import structlog
import torch

import cachedaemon.protocol as protocol
import cachedaemon.readonly as readonly
from cachedaemon.backends import Mapping, get_backend
from cachedaemon.config import CacheConfig, LoadOptions, checkpoint_changes
from cachedaemon.digest import FileDigest, differences, digest_dir
from cachedaemon.errors import CacheError, CacheMismatch, DaemonUnavailable
from cachedaemon.hf import fill_buffers
from cachedaemon.loader import load_state_dict
from cachedaemon.pool import views
from holdfast_contract import wire
from holdfast_contract.errors import ProtocolError

log = structlog.get_logger("cachedaemon.client")


class AttachReport(msgspec.Struct, frozen=True):
    source: str  # "daemon" | "disk"
    ms: float
    tensors: int
    bytes: int
    socket: str = ""
    fallback_reason: str = ""


class Attached:
    """The state dict of one attach, and the mappings behind it."""

    def __init__(self, tensors: dict[str, torch.Tensor], mappings: list[Mapping]) -> None:
        self.tensors = tensors
        self.mappings = mappings


VERIFY_MODES = ("stat", "content")


def attach(
    socket_path: str | Path,
    config: CacheConfig | None = None,
    *,
    timeout: float = 10.0,
    model_dir: str | Path | None = None,
    verify: str = "stat",
) -> Attached:
    """Connect, get manifest + fds, map every chunk read-only, build the views. Every
    failure is a CacheError (a bad or missing reply too).

    The daemon attaches when `config` equals its pool's: the checkpoint's files as stat
    sees them included, so no tensor data is read here. When only those stat facts differ
    (a copy of the checkpoint, or files written since the load), `verify="content"`
    digests `model_dir`'s files and attaches if they hold the bytes the pool was made of;
    otherwise CacheMismatch names each file that differs and how."""
    if verify not in VERIFY_MODES:
        raise CacheError(f"verify {verify!r} is not one of {', '.join(VERIFY_MODES)}")
    if verify == "content" and model_dir is None:
        raise CacheError('verify="content" needs model_dir: the dir whose files to digest')
    reply, fds = _request(socket_path, protocol.AttachRequest(config), timeout)
    content: tuple[FileDigest, ...] = ()
    content_dir = model_dir if verify == "content" else None
    if isinstance(reply, protocol.Mismatch) and reply.fields == ["checkpoint"] and content_dir:
        content = _digest(content_dir)
        reply, fds = _request(socket_path, protocol.AttachRequest(config, content), timeout)
    if isinstance(reply, protocol.Mismatch):
        raise mismatch(reply, config, str(socket_path), model_dir, content)
    if not isinstance(reply, protocol.AttachReply):
        wire.close_fds(fds)
        detail = reply.message if isinstance(reply, protocol.ErrorReply) else type(reply).__name__
        raise CacheError(f"daemon at {socket_path} refused the attach: {detail}")
    manifest = reply.manifest
    if len(fds) != len(manifest.chunks):
        wire.close_fds(fds)
        raise CacheError(f"daemon sent {len(fds)} fds for {len(manifest.chunks)} chunks")
    backend = get_backend(manifest.backend, manifest.device)
    try:
        mappings = [backend.open(fd, c.size) for fd, c in zip(fds, manifest.chunks, strict=True)]
    finally:
        wire.close_fds(fds)  # a mapping outlives its fd
    tensors = views(manifest, [m.tensor for m in mappings])
    if manifest.backend == "memfd":  # host memory: a write faults; say so when it does
        readonly.guard([(t.data_ptr(), t.nbytes, name) for name, t in tensors.items()])
    return Attached(tensors, mappings)


def _digest(model_dir: str | Path) -> tuple[FileDigest, ...]:
    t0 = time.perf_counter()
    content = digest_dir(model_dir)
    log.info(
        "checkpoint files differ from the pool's by stat; compared their content",
        model=str(model_dir),
        ms=round((time.perf_counter() - t0) * 1e3, 1),
    )
    return content


def _request(
    socket_path: str | Path, msg: protocol.AttachRequest, timeout: float
) -> tuple[protocol._Msg, list[int]]:
    try:
        return protocol.call(str(socket_path), msg, max_fds=wire.MAX_FDS, timeout=timeout)
    except ProtocolError as exc:
        raise CacheError(f"daemon at {socket_path}: {exc}") from exc


def mismatch(
    reply: protocol.Mismatch,
    config: CacheConfig | None,
    socket_path: str,
    model_dir: str | Path | None,
    content: tuple[FileDigest, ...],
) -> CacheMismatch:
    """The refusal as an error that names every field and file that differs."""
    others = [f for f in reply.fields if f != "checkpoint"]
    parts = [f"fields that differ: {', '.join(others)}"] if others else []
    files: list[str] = []
    where = model_dir if model_dir is not None else "DIR"
    stat_only = False
    if "checkpoint" in reply.fields and content:
        files = (
            differences(content, reply.files)
            if reply.files
            else ["the pool keeps no content digest: restart its daemon to load one"]
        )
        parts.append(
            f"{where} does not hold the bytes the pool was loaded from ({'; '.join(files)})"
        )
    elif "checkpoint" in reply.fields and config is not None:
        files = checkpoint_changes(config, reply.served)
        stat_only = _sizes(config) == _sizes(reply.served)  # could be a copy of its bytes
        copy = (
            f"; `cachedaemon verify --socket {socket_path} --model {where}` compares its "
            "content with the pool's"
        )
        parts.append(
            f"{where} is not the file set the pool was loaded from ({'; '.join(files)})"
            + (copy if stat_only else "")
        )
    message = f"the daemon on {socket_path} serves a pool of another checkpoint or config: "
    return CacheMismatch(reply.fields, message + "; ".join(parts), files, stat_only)


def _sizes(config: CacheConfig) -> list[tuple[str, int]]:
    return [(f.name, f.size) for f in config.checkpoint]


def attach_state_dict(
    socket_path: str | Path,
    config: CacheConfig | None = None,
    *,
    timeout: float = 10.0,
    model_dir: str | Path | None = None,
    verify: str = "stat",
) -> dict[str, torch.Tensor]:
    """Read-only tensors that are views of the daemon's pool. No copy is made. `verify`
    and `model_dir` as for `attach`."""
    return attach(socket_path, config, timeout=timeout, model_dir=model_dir, verify=verify).tensors


def attach_model(
    module: torch.nn.Module,
    socket_path: str | Path,
    config: CacheConfig | None = None,
    *,
    model_dir: str | Path | None = None,
    fallback: bool = False,
    timeout: float = 10.0,
    copy: bool | Collection[str] = False,
    verify: str = "stat",
) -> AttachReport:
    """Replace every parameter and buffer of a meta-device module with pool views.

    The views are read-only (a write into one ends the process with SIGSEGV and a message
    naming the tensor): `copy=True` gives the module private copies of every tensor
    instead, `copy=["name", ...]` of those only (memory of their own, free to change).
    Raises CacheError when a tensor's shape or dtype differs or anything stays on meta.
    With fallback and model_dir, a missing daemon or a mismatch loads from disk instead
    (the report's fallback_reason says which field or file differed). `verify="content"`
    accepts a pool whose config differs only in the checkpoint files' stat facts when
    model_dir's files hold its bytes (see `attach`).
    """
    t0 = time.perf_counter()
    source, reason = "daemon", ""
    try:
        state = attach_state_dict(
            socket_path, config, timeout=timeout, model_dir=model_dir, verify=verify
        )
    except (DaemonUnavailable, CacheMismatch) as exc:
        if not (fallback and model_dir is not None):
            raise
        source, reason = "disk", str(exc)
        log.warning("attach failed; loading from disk", socket=str(socket_path), reason=reason)
        state = load_state_dict(model_dir, None if config is None else LoadOptions.of(config))
    nbytes = assign(module, _private_copies(state, copy))
    return AttachReport(
        source, (time.perf_counter() - t0) * 1e3, len(state), nbytes, str(socket_path), reason
    )


def _private_copies(
    state: dict[str, torch.Tensor], copy: bool | Collection[str]
) -> dict[str, torch.Tensor]:
    """`state` with the tensors `copy` names (all for True) cloned out of the pool."""
    if copy is False:
        return state
    names = set(state) if copy is True else set(copy)
    unknown = sorted(names - set(state))
    if unknown:
        raise CacheError(
            f"attach_model(copy=...) names {unknown[:3]}, which the pool does not hold; "
            f"its names are the checkpoint's (first: {sorted(state)[:3]})"
        )
    return {k: v.clone() if k in names else v for k, v in state.items()}


def load_from_disk(
    module: torch.nn.Module, model_dir: str | Path, opts: LoadOptions | None = None
) -> AttachReport:
    """What a daemon would serve for `opts`, loaded from disk into this process's memory
    and put in place of the module's meta tensors: for an engine told to use no daemon."""
    t0 = time.perf_counter()
    state = load_state_dict(model_dir, opts)
    nbytes = assign(module, state)
    return AttachReport("disk", (time.perf_counter() - t0) * 1e3, len(state), nbytes)


def assign(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> int:
    """Put state's tensors in place of the module's parameters and buffers, by name."""
    nbytes = 0
    done: dict[int, torch.Tensor] = {}  # id of a replaced tensor -> its view (tied weights)
    for name, tensor in _slots(module):
        src = state.get(name, done.get(id(tensor)))
        if src is None:
            continue
        if not isinstance(src, torch.nn.Parameter) and isinstance(tensor, torch.nn.Parameter):
            src = torch.nn.Parameter(src, requires_grad=False)
        done[id(tensor)] = src
        if src.shape != tensor.shape or src.dtype != tensor.dtype:
            raise CacheError(
                f"{name}: the pool holds {src.dtype} {list(src.shape)}, "
                f"the module wants {tensor.dtype} {list(tensor.shape)}"
            )
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        if isinstance(src, torch.nn.Parameter):
            setattr(owner, leaf, src)
        else:
            owner._buffers[leaf] = src
        nbytes += src.nbytes
    device = next(iter(state.values())).device if state else torch.device("cpu")
    filled = fill_buffers(module, device)  # not in any checkpoint: the model's init makes them
    if filled:
        log.info("buffers computed by the model's init", count=len(filled), first=filled[:3])
    left = [n for n, t in _slots(module) if t.is_meta]
    if left:
        raise CacheError(
            f"{len(left)} tensors still on the meta device after attach (first: {left[:3]}); "
            "the checkpoint lacks them or names them differently. A buffer in no checkpoint "
            "must be real before attach: build Hugging Face models with "
            "cachedaemon.hf.empty_model(), others with parameters only on meta"
        )
    return nbytes


def _slots(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]
