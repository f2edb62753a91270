"""The `update` and `refit` faults: a rolling model update (`supervisor update --model
DIR`) or an in-place refit (`supervisor refit --model DIR`) asked of the supervisor over
its control socket, followed until `/cluster`'s `update` says it finished or rolled back
(holdfast_contract.control.UpdateStatus); then what it left: how it ended against the
fault's `expect`, and the pool memory held, in pools (chaos/pools.py), once it ended and
at most while it ran (read at each wake-up)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec

from chaos.cluster import Supervisor
from chaos.errors import FaultError
from chaos.pools import pool_bytes
from holdfast_contract.control import ControlRequest, RefitReq, UpdateReq, UpdateStatus
from supervisor.control import request
from supervisor.errors import ControlError

DONE = frozenset({"finished", "rolled-back"})
WAKE_S = 0.25  # re-read /cluster at least this often while an update runs


class Ended(msgspec.Struct, frozen=True):
    """How an update or a refit ended, as the trial measures it."""

    state: str  # finished | rolled-back | "" (not within the trial's time)
    ms: float | None  # the request -> the end seen
    pool_bytes: int  # held once it ended
    peak_bytes: int  # the most held while it ran (the new pool beside the old)
    detail: str = ""  # the supervisor's: why it rolled back

    def copies(self, one_pool: int, held: int | None = None) -> float | None:
        """The pool memory held once it ended (or `held`), in pools of `one_pool` bytes
        (None: no pool measured)."""
        held = self.pool_bytes if held is None else held
        return round(held / one_pool, 3) if one_pool > 0 else None

    def said(self) -> str:
        """The end for the trial's note."""
        how = self.state or "not ended"
        took = f" after {self.ms / 1000:.1f}s" if self.ms is not None else ""
        return f"{how}{took}" + (f" ({self.detail})" if self.detail else "")


async def ask(sup: Supervisor, kind: str, target: Path) -> float:
    """Send the update (or refit) to `target`; the wall-clock time it was sent. FaultError
    with the supervisor's words when it refuses."""
    req: ControlRequest = (
        UpdateReq(model=str(target)) if kind == "update" else RefitReq(model=str(target))
    )
    sent = time.time()
    try:
        reply = await asyncio.to_thread(request, f"ipc://{sup.run_dir}/control", req)
    except ControlError as exc:
        raise FaultError(f"{kind} to {target}: {exc}") from exc
    if not reply.ok:
        raise FaultError(f"the supervisor refused the {kind} to {target}: {reply.message}")
    return sent


def mine(st: UpdateStatus | None, kind: str, target: Path, sent: float) -> bool:
    """Whether `st` is the end of the update asked at `sent` (not an earlier one's)."""
    return (
        st is not None
        and st.state in DONE
        and st.kind == kind
        and st.model == str(target)
        and st.started >= sent
    )


async def until_ended(
    sup: Supervisor,
    kind: str,
    target: Path,
    sent: float,
    timeout: float,
    changed: Callable[[float], Awaitable[None]],
) -> Ended:
    """Wait (waking at each event, `changed`) for the update's end, up to `timeout`."""
    deadline, peak = time.monotonic() + timeout, 0
    while True:
        view = await sup.cluster()
        st = view.update if view is not None else None
        held = pool_bytes(sup.processes())
        peak = max(peak, held)
        if mine(st, kind, target, sent) and st is not None:
            ms = round((time.time() - sent) * 1000.0, 1)
            return Ended(st.state, ms, held, peak, st.detail)
        left = deadline - time.monotonic()
        if left <= 0:
            said = f"; last seen: {st.kind} {st.state} ({st.model})" if st is not None else ""
            return Ended("", None, held, peak, f"no end in {timeout:g}s{said}")
        await changed(min(WAKE_S, left))
