"""A refit: new weights of the same names and shapes, switched in by the engines that run,
without a restart (a trainer's step: `supervisor refit --model DIR`).

The next generation of cache daemons loads the new checkpoint into a pool of its own while
the old one serves (as an update's does). Then every engine maps it in place of the old one
(`Refit`, engine/refit.py): the standbys first, at once (nothing is routed to them); then
the primary's place passes to a refitted standby in one fenced, epoch-raising step
(`Failover.switch`), so new requests go to the new version from that moment; the old
primary finishes its requests in flight on the old weights (`update.drain_s`), then maps
the new pool too and stands by again; batch engines follow, each once its own requests are
done. No answer is made by two versions: an engine takes nothing new while it refits, and
swaps only when nothing is in flight on it. An engine that cannot refit in time (requests
still in flight past `update.drain_s`) is restarted on the new pool instead; a crew with no
standby refits its primary where it serves (new requests wait, retried by the router,
until its requests in flight are done). The old pool is kept `update.keep_old_s` for a
rollback (switched back as an update is), then freed: no engine maps it any more.

A refit that fails before the switch (the pool not serving in time, a layout the engines
refuse) is rolled back: the standbys already refitted map the old pool again, the new pool
is freed; the old version served throughout."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING, Any

import structlog

from holdfast_contract.agent_protocol import Refit, Refitted
from holdfast_contract.events import EventName as N
from supervisor.errors import ControlError
from supervisor.states import EngineState
from supervisor.units import Engine
from supervisor.update.steps import versions
from supervisor.versions import Source

if TYPE_CHECKING:
    from supervisor.core import Crew
    from supervisor.daemons import CacheDaemons
    from supervisor.update.steps import Steps

log = structlog.get_logger("supervisor.update.refit")
S = EngineState
STANDBY_GRACE_S = 5.0  # a standby's in flight: warm prefills and a smoke request at most
REWARM_POLL_S = 0.005


class RefitFailed(Exception):
    """An engine did not switch to the new pool; the message says which and why."""


def refusal(c: Crew) -> str:
    """Why this crew's engines cannot refit in place ("": they can)."""
    p = c.policy
    if p.engines.kind != "holdfast":
        return (
            f"engines of kind {p.engines.kind} do not refit in place; "
            "use `supervisor update --model DIR`, which starts new engines on the new pool"
        )
    if p.model.tp_size > 1:
        return (
            f"engines of {p.model.tp_size} tensor-parallel ranks do not refit in place; "
            "use `supervisor update --model DIR`"
        )
    return ""


async def tell(
    c: Crew,
    e: Engine,
    src: Source,
    grace_s: float,
    timeout_s: float,
    *,
    hold: bool = False,
    cut: bool = False,
) -> Refitted:
    """Tell `e` to switch to `src`'s pool (with `cut`, cutting what it has in flight);
    its answer (RefitFailed when it does not switch, exits first, or does not answer
    within `timeout_s`)."""
    waiter: asyncio.Future[Refitted] = asyncio.get_running_loop().create_future()
    c.refits[e.name] = waiter
    cmd = Refit(src.daemons[0], src.model_dir, src.version, grace_s, hold, cut)
    if not c.hub.send(e.name, cmd):
        c.refits.pop(e.name, None)
        raise RefitFailed(f"{e.name} is not connected")
    inc = e.inc
    gone: asyncio.Future[None] = asyncio.ensure_future(
        c.until(lambda: e.inc is not inc or not e.running)
    )
    either: set[asyncio.Future[Any]] = {waiter, gone}
    try:
        async with asyncio.timeout(timeout_s):
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    except TimeoutError:
        raise RefitFailed(f"{e.name} did not answer the refit within {timeout_s:g} s") from None
    finally:
        gone.cancel()
        c.refits.pop(e.name, None)
    if not waiter.done():
        raise RefitFailed(f"{e.name} exited during its refit")
    said = waiter.result()
    if not said.ok:
        raise RefitFailed(f"{e.name}: {said.detail}")
    e.source = src
    if e.state == S.DRAINING:  # a superseded primary: it stands by again
        c.rejoin(e, ms=said.ms, swap_ms=said.swap_ms)
    else:
        c.publish(e, N.REFITTED, version=src.version, ms=said.ms, swap_ms=said.swap_ms)
    return said


async def go(r: Steps, gen: CacheDaemons) -> None:
    """One refit to `gen`'s pool (built here)."""
    c, spec = r.c, r.spec
    r.emit(N.STARTED, model=gen.model_dir, back=False, refit=True)
    old_src = r.launcher.source
    done: list[Engine] = []
    try:
        async with asyncio.timeout(spec.ready_timeout_s):
            await gen.start()
            src = gen.source()
            if src.version == c.version:
                raise RefitFailed(
                    f"{gen.model_dir} holds the bytes of the version that serves "
                    f"({src.version}): nothing to refit"
                )
            r.status("refitting", version_to=src.version, detail="the standbys switch")
            for e in _serving(c, S.STANDBY, c.version):
                await tell(c, e, src, STANDBY_GRACE_S, spec.ready_timeout_s)
                done.append(e)
        r.emit(N.READY, version=src.version, engines={e.name: e.version for e in done})
        heir = await _rewarmed(r, src) if spec.refit_inflight == "retry" else None
    except (TimeoutError, RefitFailed, ControlError) as e:
        c.warm_next("")
        await _back(r, done, old_src)
        why = str(e) or (
            f"the new pool did not serve within update.ready_timeout_s ({spec.ready_timeout_s:g} s)"
        )
        await r.refused(gen, [], why, built=True)
        return
    except asyncio.CancelledError:
        c.warm_next("")
        if not r.closing:
            await _back(r, done, old_src)
            await r.refused(gen, [], "rolled back by hand", built=True)
        raise
    await _switch(r, gen, src, heir if heir in done else None, done)


async def _rewarmed(r: Steps, src: Source) -> Engine | None:
    """With update.refit_inflight: retry, the streams the old primary will cut go on on
    the refitted standby that takes its place: before the switch, the router keeps their
    pasts warm there, on the new weights (the standby gave back what it kept when it
    refitted), so each continuation prefills only its last few tokens, not its whole
    past. At most update.rewarm_s: then the switch goes on regardless. The standby, or None where
    nothing is kept warm (router.warm_every 0, engines.kv_adopt's keys)."""
    c = r.c
    heir = c.warm_next(src.version)
    target = c.view.heir
    if heir is None or target is None:
        return None
    t0 = time.monotonic()
    while not c.view.warm_on(target) and time.monotonic() - t0 < r.spec.rewarm_s:
        await asyncio.sleep(REWARM_POLL_S)
    warm = c.view.warm_on(target)
    log.info(
        "refit heir warm" if warm else "refit heir not warm in time; switching",
        engine=heir.name,
        ms=round((time.monotonic() - t0) * 1e3, 1),
    )
    return heir


async def _switch(
    r: Steps, gen: CacheDaemons, src: Source, warm: Engine | None, done: list[Engine]
) -> None:
    c, before = r.c, r.c.version
    heir = warm if warm is not None and warm.state == S.STANDBY else None
    heir = heir or next((e for e in done if e.state == S.STANDBY), None)
    r.status("switching")
    old: Engine | None = None
    if heir is not None:
        # the old primary's answers cut by update.refit_inflight: retry go on on the heir
        old = c.switch(heir, continues=r.spec.refit_inflight == "retry")
        c.warm_next("")  # the version served now is the one warmed
        if old is not None and r.spec.refit_inflight == "retry":
            c.warm_through_cut(heir)
    elif c.primary is not None:  # no standby: the primary refits where it serves
        await _in_place(r, c.primary, src, hold=True)
        c.serve_version(src.version)
    c.daemons, r.launcher.source = gen, src
    r.kept, r.current = r.current, gen
    r.emit(N.SWITCHED, version=src.version, previous=before, engines=versions(c), refit=True)
    r.status("draining", detail="the old primary finishes its requests, then refits")
    if old is not None:
        try:
            await _rejoin(r, old, src)
        finally:
            c.warm_through_cut(None)
    for e in [e for e in c.engines.values() if e.version != src.version]:
        if e.running and e.state in (S.STANDBY, S.BATCH):
            await _in_place(r, e, src)
            continue
        e.source = src  # not running: it starts on the new pool
        if e.state == S.STARTING:  # started on the old one: again, on the new
            with contextlib.suppress(ControlError):
                await c.restart(e)
    await r.keep_then_free(src, back=False)


async def _in_place(r: Steps, e: Engine, src: Source, *, hold: bool = False) -> None:
    """`e` refits once its requests in flight are done (new ones wait for it with `hold`,
    else get 503); past update.drain_s it is restarted on the new pool instead."""
    try:
        timeout = r.spec.drain_s + r.spec.ready_timeout_s
        await tell(r.c, e, src, r.spec.drain_s, timeout, hold=hold)
    except RefitFailed as why:
        log.warning("refit in place failed; restarted on the new pool", engine=e.name, why=str(why))
        e.source = src
        with contextlib.suppress(ControlError):
            await r.c.restart(e)


async def _rejoin(r: Steps, old: Engine, src: Source) -> None:
    """The superseded primary finishes its requests on the old weights, refits, and stands
    by again; past update.drain_s it is stopped (what it had not finished ends with an
    error: never continued on another version) and restarted on the new pool."""
    c, cut = r.c, r.spec.refit_inflight == "retry"
    try:
        await tell(c, old, src, r.spec.drain_s, r.spec.drain_s + r.spec.ready_timeout_s, cut=cut)
    except RefitFailed as why:
        log.warning("old primary did not refit; restarted", engine=old.name, why=str(why))
        await r.drain(old)  # fenced past drain_s, then out of the crew
        r.add_serving(src, count=1)
        return


async def _back(r: Steps, done: list[Engine], old: Source) -> None:
    """The standbys already refitted map the old pool again (or restart on it)."""
    for e in done:
        try:
            await tell(r.c, e, old, STANDBY_GRACE_S, r.spec.ready_timeout_s)
        except RefitFailed:
            e.source = old
            with contextlib.suppress(ControlError):
                await r.c.restart(e)


def _serving(c: Crew, state: S, version: str) -> list[Engine]:
    return [
        e for e in c.engines.values() if e.serving and e.state == state and e.version == version
    ]
