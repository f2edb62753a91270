"""The policy's `update:` section: deadlines of a rolling model update, its smoke
request, and whether it may stop the old standbys for room. Imported by supervisor/policy.py; imports nothing of the supervisor."""

from __future__ import annotations

from typing import Literal

import msgspec


class SmokeSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One completion a new version's standby must answer with HTTP 200 before the switch."""

    prompt: str = "Hello"
    max_tokens: int = 4


class UpdateSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    ready_timeout_s: float = 120.0  # the new pool serving and its standbys ready, or rollback
    drain_s: float = 30.0  # the old primary's requests in flight finish within, or end
    keep_old_s: float = 10.0  # the old pool is kept this long after the switch (rollback)
    smoke: SmokeSpec | None = None  # unset: no smoke request
    # where two pools do not fit at once: stop the old standbys before the new pool is
    # built (their memory back; no failover target of the old version meanwhile)
    free_standby_kv: bool = False
    # a cache daemon per rank started ahead (imported, its CUDA context made) that the next
    # update's or refit's pool is loaded by (supervisor/update/parked.py); auto: on CUDA
    # devices only
    park: Literal["auto"] | bool = "auto"
    # a refit's old primary, once its place passed to a refitted standby: finish its
    # requests in flight on the old weights first (no answer made by two versions), or
    # retry: cut them at once and refit, the router answering them from the new weights
    # (a collected answer made again whole, a stream continued from what its client has)
    refit_inflight: Literal["finish", "retry"] = "finish"
    # with retry, the switch first waits (at most this long) until the router keeps every
    # stream's past warm on the refitted heir, on the new weights: each cut stream then
    # goes on there prefilling only its last few tokens (router.warm_every)
    rewarm_s: float = 1.0


def update_errors(spec: UpdateSpec) -> list[str]:
    """The rules of the section, each naming its key."""
    errors = [
        f"$.update.{key}: got {value:g}, must be > 0"
        for key, value in (("ready_timeout_s", spec.ready_timeout_s), ("drain_s", spec.drain_s))
        if value <= 0
    ]
    for key, value in (("keep_old_s", spec.keep_old_s), ("rewarm_s", spec.rewarm_s)):
        if value < 0:
            errors.append(f"$.update.{key}: got {value:g}, must be >= 0")
    if spec.smoke is not None and spec.smoke.max_tokens < 1:
        errors.append(f"$.update.smoke.max_tokens: got {spec.smoke.max_tokens}, must be >= 1")
    return errors
