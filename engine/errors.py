"""One root exception for the reference engine; each says what to change."""

from __future__ import annotations

from holdfast_contract.errors import HoldfastError


class EngineError(HoldfastError):
    """Root of every error the engine raises on purpose."""


class AgentError(EngineError):
    """An engine's agent cannot start as configured; the message names the variable to fix."""


class ModelConfigError(EngineError):
    """The checkpoint's config.json cannot be served by this engine as asked."""


class WeightsError(EngineError):
    """Weights could not be attached from the daemon nor loaded from disk."""


class BadRequest(EngineError):
    """A request the engine refuses (HTTP 400); the message says which field to fix."""


class Unavailable(EngineError):
    """The engine is up but does not serve this request now (HTTP 503)."""


class QueueFull(Unavailable):
    """Every KV block is taken and the waiting queue is at its bound (HTTP 503, Retry-After)."""

    retry_after_s = 1
