"""Fault injectors. Each finds its victim in the crew's status, signals it, and says what a
recovery looks like; `heal` undoes what must be undone (SIGCONT, broker back up).

Signals go only to processes below the supervisor the suite started.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Awaitable, Callable

import aiohttp
import msgspec
import structlog

from chaos import updates
from chaos.broker import OwnBroker
from chaos.cluster import Supervisor
from chaos.crew import absent_batch, coming_batch
from chaos.errors import FaultError, VictimAbsent, VictimComing
from chaos.models import Checkpoints
from chaos.procs import ProcRef, wait_gone
from chaos.scenario import FaultSpec
from holdfast_contract.control import CrewStatus
from holdfast_contract.env import var
from supervisor.policy import Policy

log = structlog.get_logger("chaos.faults")

LINGER_GRACE_S = 5.0


class Victim(msgspec.Struct, frozen=True):
    kind: str  # engine | daemon | broker | supervisor | update
    name: str
    ref: ProcRef | None


class Injection(msgspec.Struct, frozen=True):
    victims: list[Victim]
    injected: float  # wall clock, seconds
    lingering: int = 0
    note: str = ""
    model: str = ""  # update, refit: the checkpoint dir it goes to


class FaultContext(msgspec.Struct):
    sup: Supervisor
    broker: OwnBroker | None
    view: CrewStatus
    spec: FaultSpec
    checkpoints: Checkpoints | None = None  # the dirs of the stage's update and refit models


def requirement(fault: str, policy: Policy, own_broker: bool, attached: bool) -> str | None:
    """Why `fault` cannot run against `policy`, or None when it can."""
    engines = policy.engines
    needs = {
        "kill-standby": (engines.standby >= 1, "engines.standby >= 1"),
        "stop-standby": (engines.standby >= 1, "engines.standby >= 1"),
        "kill-batch": (sum(b.count for b in engines.batch) >= 1, "an engines.batch entry"),
        "stop-batch": (sum(b.count for b in engines.batch) >= 1, "an engines.batch entry"),
        "memory-pressure": (sum(b.count for b in engines.batch) >= 1, "an engines.batch entry"),
        "kill-tp-rank": (policy.model.tp_size >= 2, "model.tp_size >= 2"),
        "restart-broker": (own_broker and not attached, "the suite's own broker (not --attach)"),
        "kill-supervisor": (not attached, "a supervisor the suite started (not --attach)"),
    }
    ok, what = needs.get(fault, (True, ""))
    return None if ok else f"fault {fault} needs {what} in policy {policy.source}"


def _engine(ctx: FaultContext, state: str) -> Victim:
    if state == "primary":
        engine = ctx.view.engine(ctx.view.primary or "")
        found = [engine] if engine is not None and engine.pid else []
    else:
        found = ctx.view.in_state(state)
    if not found and state == "batch":
        why = absent_batch(ctx.view)
        if why is not None:
            raise VictimAbsent(why)
        coming = coming_batch(ctx.view)
        if coming:
            raise VictimComing(f"no batch engine ready yet ({', '.join(coming)})")
    if not found:
        raise FaultError(f"no {state} engine to target; the policy runs none ready right now")
    return _own(ctx, "engine", found[0].name, found[0].pid)


def _daemon(ctx: FaultContext) -> Victim:
    daemon = next((d for d in ctx.view.daemons if d.rank == 0 and d.pid), None)
    if daemon is None:
        raise FaultError("no rank-0 cache daemon with a pid in /cluster")
    return _own(ctx, "daemon", str(daemon.rank), daemon.pid)


def _tp_rank(ctx: FaultContext) -> Victim:
    """The primary's last tensor-parallel rank (its pid from /cluster: a forked engine's
    /proc environ is its fork server's, so it cannot be told apart by environment)."""
    primary = ctx.view.engine(ctx.view.primary or "")
    if primary is None or len(primary.pids) < 2:
        raise FaultError("kill-tp-rank needs a primary of tp_size >= 2 in /cluster")
    return _own(ctx, "engine", primary.name, primary.pids[-1])


def _own(ctx: FaultContext, kind: str, name: str, pid: int | None) -> Victim:
    own = {ref.pid: ref for ref in ctx.sup.children()}
    if pid is None or pid not in own:
        raise FaultError(f"{kind} {name} (pid {pid}) is not a process of this supervisor")
    return Victim(kind, name, own[pid])


def _signal(victims: list[Victim], sig: signal.Signals) -> Injection:
    injected = time.time()
    for victim in victims:
        if victim.ref is not None:
            victim.ref.signal(sig)
    return Injection(victims, injected)


async def inject(fault: str, ctx: FaultContext) -> Injection:
    sig = signal.SIGSTOP if fault.startswith("stop-") else signal.SIGKILL
    pickers: dict[str, Callable[[FaultContext], list[Victim]]] = {
        "primary": lambda c: [_engine(c, "primary")],
        "standby": lambda c: [_engine(c, "standby")],
        "batch": lambda c: [_engine(c, "batch")],
        "daemon": lambda c: [_daemon(c)],
        "tp-rank": lambda c: [_tp_rank(c)],
        "daemon-and-primary": lambda c: [_daemon(c), _engine(c, "primary")],
    }
    target = fault.split("-", 1)[-1]
    if target in pickers:
        return _signal(pickers[target](ctx), sig)
    special: dict[str, Callable[[FaultContext], Awaitable[Injection]]] = {
        "restart-broker": _stop_broker,
        "kill-supervisor": _kill_supervisor,
        "memory-pressure": _memory_pressure,
        "update": _update,
        "refit": _update,
    }
    return await special[fault](ctx)


async def heal(fault: str, ctx: FaultContext, injection: Injection) -> None:
    """Undo what the fault left behind, `hold_s` after it: SIGCONT, broker back up."""
    if fault.startswith("stop-") or fault == "restart-broker":
        await asyncio.sleep(ctx.spec.hold_s)
    if fault.startswith("stop-"):
        for victim in injection.victims:
            if victim.ref is not None:
                victim.ref.signal(signal.SIGCONT)
    elif fault == "restart-broker" and ctx.broker is not None:
        await ctx.broker.start()


async def _stop_broker(ctx: FaultContext) -> Injection:
    """Stop the broker, then kill the primary while it is away: failover must not wait on it."""
    if ctx.broker is None:
        raise FaultError("restart-broker needs the suite's own broker")
    await ctx.broker.stop()
    primary = _engine(ctx, "primary")
    injection = _signal([primary], signal.SIGKILL)
    return msgspec.structs.replace(
        injection,
        victims=[Victim("broker", "mqtt", None), primary],
        note="broker stopped, primary killed during the outage",
    )


async def _kill_supervisor(ctx: FaultContext) -> Injection:
    children = ctx.sup.children()
    injected = time.time()
    ref = await ctx.sup.kill()
    left = await wait_gone(children, LINGER_GRACE_S)
    for orphan in left:
        log.error("lingering_child", pid=orphan.pid, name=orphan.env(var("name")))
        orphan.signal(signal.SIGKILL)
    await wait_gone(left, LINGER_GRACE_S)
    await ctx.sup.start()
    note = f"{len(left)} of {len(children)} children outlived the supervisor" if left else ""
    return Injection([Victim("supervisor", "main", ref)], injected, len(left), note)


async def _update(ctx: FaultContext) -> Injection:
    """An update (or a refit) to the first of the fault's models that does not serve now."""
    if ctx.checkpoints is None:
        raise FaultError(f"{ctx.spec.kind} has no checkpoints prepared for this stage")
    target = ctx.checkpoints.next(ctx.spec.models)
    sent = await updates.ask(ctx.sup, ctx.spec.kind, target)
    victim = Victim("update", ctx.spec.kind, None)
    return Injection([victim], sent, note=f"{ctx.spec.kind} to {target.name}", model=str(target))


async def _memory_pressure(ctx: FaultContext) -> Injection:
    """KV-cache pressure on the primary: a burst of long streamed requests above
    `engines.load.evict_above`, held for `hold_s` from the moment the last of them was
    taken (its answer began: the engine counts it), so the pressure lasts `hold_s` however
    long this machine takes to pass the burst on. Admission must evict a batch engine to
    make room, then bring it back once the load stays below `respawn_below`."""
    batch = _engine(ctx, "batch")
    size = ctx.spec.burst or ctx.sup.policy.engines.load.evict_above + 2
    injected = time.time()
    body = {
        "prompt_token_ids": list(range(1, 9)),
        "max_tokens": ctx.spec.burst_tokens,
        "stream": True,
    }
    url = ctx.sup.router + "/v1/completions"
    burst = await _burst(url, body, size, ctx.spec.hold_s)
    taken, refused = burst.taken, burst.refused
    note = f"burst of {size} x {ctx.spec.burst_tokens}-token requests held {ctx.spec.hold_s}s"
    if taken:
        note += f" after the last was taken ({max(taken) - injected:.2f}s after the first sent)"
    if len(taken) < size:
        note += f"; only {len(taken)} of {size} taken"
    if refused:
        note += f" ({'; '.join(sorted(set(refused)))})"
    return Injection([batch], injected, note=note)


BURST_TAKEN_S = 10.0  # the most a burst waits for all its requests to be taken


async def _burst(url: str, body: object, size: int, hold_s: float) -> _Burst:
    burst = _Burst(size)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        holds = [asyncio.ensure_future(burst.hold(session, url, body)) for _ in range(size)]
        try:  # every request taken or refused: the hold starts (at the latest after the wait)
            await asyncio.wait_for(burst.answered.wait(), BURST_TAKEN_S)
            await asyncio.sleep(hold_s)
        except TimeoutError:
            pass
        for resp in burst.open:
            # its reader ends. Not a cancelled read: with the reads cancelled, a load request
            # of this process sent at the same time waited seconds for its answer, longer
            # after each burst (the router had answered it at once)
            resp.close()
        _, late = await asyncio.wait(holds, timeout=BURST_TAKEN_S)
        for h in late:
            h.cancel()  # never taken
        await asyncio.gather(*late, return_exceptions=True)
    return burst


class _Burst:
    """The memory-pressure burst's requests: when each was taken, or why not."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.taken: list[float] = []
        self.refused: list[str] = []
        self.answered = asyncio.Event()  # every request taken or refused
        self.open: list[aiohttp.ClientResponse] = []  # taken: closed when the hold is over

    def _count(self) -> None:
        if len(self.taken) + len(self.refused) == self.size:
            self.answered.set()

    async def hold(self, session: aiohttp.ClientSession, url: str, body: object) -> None:
        """One request: streamed until it is closed (or its end), its answer unread."""
        taken = False
        try:
            async with session.post(url, json=body) as resp:
                if resp.status != 200:
                    self.refused.append(f"HTTP {resp.status}")
                    self._count()
                    return
                taken = True
                self.taken.append(time.time())
                self.open.append(resp)
                self._count()
                while await resp.content.readany():
                    pass
        except aiohttp.ClientError as e:
            if not taken:  # (a taken one's error is its closing)
                self.refused.append(type(e).__name__)
                self._count()
