"""Weights for a meta-device module: attached from this rank's daemon, or read from disk."""

from __future__ import annotations

import time

import structlog
import torch

from cachedaemon.client import AttachReport, assign, attach_model
from cachedaemon.config import make_config
from cachedaemon.errors import CacheError, CacheMismatch, DaemonUnavailable
from cachedaemon.loader import load_state_dict
from engine.config import EngineConfig
from engine.errors import WeightsError

log = structlog.get_logger("engine.weights")


def load_weights(module: torch.nn.Module, cfg: EngineConfig) -> AttachReport:
    """Fill every meta tensor of `module`; the report says from where and how fast."""
    try:
        if cfg.socket:
            return _attach(module, cfg)
        return load_from_disk(module, cfg)
    except WeightsError:
        raise
    except CacheError as e:
        raise WeightsError(f"weights for {cfg.model} (rank {cfg.rank}): {e}") from e


def _attach(module: torch.nn.Module, cfg: EngineConfig) -> AttachReport:
    config = make_config(
        cfg.model,
        dtype=cfg.dtype,
        tp_size=cfg.world_size,
        tp_rank=cfg.rank,
        quantization=cfg.quantization,
        device=cfg.device,
    )
    try:
        report = attach_model(
            module,
            cfg.socket,
            config,
            model_dir=cfg.model,
            fallback=cfg.allow_disk_fallback,
            timeout=cfg.attach_timeout_s,
        )
    except DaemonUnavailable as e:
        raise WeightsError(
            f"no daemon answers on {cfg.socket} ({e}); start `cachedaemon serve` for rank "
            f"{cfg.rank} there, fix --daemons/HOLDFAST_DAEMONS, or pass --allow-disk-fallback"
        ) from e
    except CacheMismatch as e:
        raise WeightsError(
            f"the daemon on {cfg.socket} serves a pool built for another config (fields: "
            f"{', '.join(e.fields)}); match --dtype/--quantization/--world-size to the "
            "daemon's, or pass --allow-disk-fallback"
        ) from e
    if report.source == "disk":
        log.warning("attach fell back to disk", socket=cfg.socket, reason=report.fallback_reason)
    return report


def load_from_disk(module: torch.nn.Module, cfg: EngineConfig) -> AttachReport:
    """The daemon's transforms (dtype, TP shard, quantization), into this process's memory."""
    t0 = time.perf_counter()
    state = load_state_dict(
        cfg.model,
        dtype=cfg.dtype,
        tp_size=cfg.world_size,
        tp_rank=cfg.rank,
        quantization=cfg.quantization,
        device=cfg.device,
    )
    nbytes = assign(module, state)
    return AttachReport("disk", (time.perf_counter() - t0) * 1e3, len(state), nbytes)
