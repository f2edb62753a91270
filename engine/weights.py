"""Weights for a meta-device module: attached from this rank's daemon, or read from disk.

Whether a failed attach falls back to disk is `cachedaemon.client.attach_model`'s rule;
this module only names the engine's flags in the errors it passes on.
"""

from __future__ import annotations

import structlog
import torch

from cachedaemon.client import AttachReport, attach_model, load_from_disk
from cachedaemon.config import LoadOptions, config_for
from cachedaemon.errors import CacheError, CacheMismatch, DaemonUnavailable
from engine.config import EngineConfig
from engine.errors import WeightsError

log = structlog.get_logger("engine.weights")


def load_options(cfg: EngineConfig) -> LoadOptions:
    """The daemon's load options for this engine's rank (its flags, in the daemon's terms)."""
    # dtype, tp_size, tp_rank, quantization, device
    return LoadOptions(cfg.dtype, cfg.world_size, cfg.rank, cfg.quantization, cfg.device)


def load_weights(module: torch.nn.Module, cfg: EngineConfig) -> AttachReport:
    """Fill every meta tensor of `module`; the report says from where and how fast."""
    try:
        if cfg.socket:
            return _attach(module, cfg)
        return load_from_disk(module, cfg.model, load_options(cfg))
    except WeightsError:
        raise
    except CacheError as e:
        raise WeightsError(f"weights for {cfg.model} (rank {cfg.rank}): {e}") from e


def _mismatch_hint(e: CacheMismatch) -> str:
    """What to change, in the engine's flags."""
    if set(e.fields) - {"checkpoint"}:
        return "match --dtype/--quantization/--world-size to the daemon's"
    if e.stat_only:
        return "if verify finds the same content, pass --verify content (HOLDFAST_VERIFY)"
    return "restart the daemon on this checkpoint, or point --model at the one it serves"


def _attach(module: torch.nn.Module, cfg: EngineConfig) -> AttachReport:
    try:
        report = attach_model(
            module,
            cfg.socket,
            config_for(cfg.model, load_options(cfg)),
            model_dir=cfg.model,
            fallback=cfg.allow_disk_fallback,
            timeout=cfg.attach_timeout_s,
            verify=cfg.verify,
        )
    except DaemonUnavailable as e:
        raise WeightsError(
            f"no daemon answers on {cfg.socket} ({e}); start `cachedaemon serve` for rank "
            f"{cfg.rank} there, fix --daemons/HOLDFAST_DAEMONS, or pass --allow-disk-fallback"
        ) from e
    except CacheMismatch as e:
        raise WeightsError(f"{e}; {_mismatch_hint(e)}, or pass --allow-disk-fallback") from e
    if report.source == "disk":
        log.warning("attach fell back to disk", socket=cfg.socket, reason=report.fallback_reason)
    return report
