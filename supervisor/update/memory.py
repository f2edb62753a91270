"""Whether an update's second pool fits beside the one that serves, on each device, said
before anything changes (docs/update.md "Memory").

At an update's peak, before its switch, a device holds for its ranks the pool that serves
and the new one, the engines that run now (the primary, its standbys, batch engines) and
the new version's primary and standbys, started beside them. The new pool's bytes come
from the new checkpoint's safetensors headers, laid out as the daemon lays it
(`cachedaemon.pool_plan.pool_bytes`: dtype, quantization, tensor-parallel shard); the
serving pool's from its daemons (`pool_bytes`); an engine's from `memory_mb`, else the KV
cache its command or environment asks for. The device's room is `devices.capacity_mb`
where set, else what the machine says (supervisor/update/capacity.py): for an update, what
is free now plus what holdfast holds there; for `supervisor validate`, the device's total.

Where it does not fit and `update.free_standby_kv` is set, the old standbys are stopped
before the new pool is built, giving their memory back; where it does not fit even so,
the update is refused, naming the numbers and what to change."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from cachedaemon.config import LoadOptions
from cachedaemon.errors import CacheError
from cachedaemon.pool_plan import pool_bytes
from holdfast_contract.env import var
from supervisor.errors import ControlError
from supervisor.policy import Policy
from supervisor.update.capacity import MB, Capacity, CapacityUnknown, of_device

if TYPE_CHECKING:
    from supervisor.core import Crew
    from supervisor.daemons import CacheDaemons
    from supervisor.units import Engine

# what an engine without memory_mb asks for its KV cache: flags of its command, in bytes
# per unit, and variables of its environment (the reference engine's, vLLM's)
KV_FLAGS = {"--kv-cache-mb": MB, "--kv-cache-memory-bytes": 1}
KV_ENV = {var("kv_cache_mb"): MB, "VLLM_CPU_KVCACHE_SPACE": 1 << 30}


class Room(msgspec.Struct, frozen=True):
    """One device at an update's peak, in bytes."""

    device: str
    ranks: tuple[int, ...]
    serving_pool: int
    new_pool: int
    engines: int  # the engines that run (or, for validate, may run) now
    new_engines: int  # the new version's primary and standbys
    standbys: int  # of `engines`, the old standbys': update.free_standby_kv gives them back
    room: int | None  # what holdfast may hold there at the peak; None: not known
    room_why: str  # where `room` comes from, or why it is not known

    def need(self, give_up: bool) -> int:
        given = self.standbys if give_up else 0
        return self.serving_pool + self.new_pool + self.engines + self.new_engines - given

    def fits(self, give_up: bool) -> bool:
        return self.room is None or self.need(give_up) <= self.room

    def line(self, give_up: bool) -> str:
        """`cpu (rank 0): fits: pools ... = 101.2 MB of 200.0 MB (devices.capacity_mb)`."""
        sums = (
            f"pools {_mb(self.serving_pool)} serving + {_mb(self.new_pool)} new, engines "
            f"{_mb(self.engines)} now + {_mb(self.new_engines)} new"
        )
        if give_up and self.standbys:
            sums += f" - {_mb(self.standbys)} of the old standbys"
        sums += f" = {_mb(self.need(give_up))}"
        where = f"{self.device} (rank {','.join(map(str, self.ranks))})"
        if self.room is None:
            return f"{where}: not checked: {sums}; {self.room_why}"
        verdict = "fits" if self.fits(give_up) else "does not fit"
        return f"{where}: {verdict}: {sums} of {_mb(self.room)} ({self.room_why})"


class Verdict(msgspec.Struct, frozen=True):
    """Every device's room; whether both pools fit, and whether only once the old
    standbys are stopped (`give_up`, allowed by update.free_standby_kv)."""

    rooms: tuple[Room, ...]
    allowed: bool  # update.free_standby_kv
    unknown: tuple[str, ...] = ()  # engines whose memory is not known (counted as 0)

    @property
    def give_up(self) -> bool:
        plain = all(r.fits(False) for r in self.rooms)
        return not plain and self.allowed and all(r.fits(True) for r in self.rooms)

    @property
    def fits(self) -> bool:
        return all(r.fits(self.give_up) for r in self.rooms)

    def lines(self) -> list[str]:
        out = [r.line(self.give_up) for r in self.rooms]
        if self.unknown:
            out.append(
                f"memory not known, counted as 0: {', '.join(self.unknown)} (set "
                "engines.memory_mb, engines.batch[].memory_mb or the engine's KV cache flag)"
            )
        return out

    def fixes(self) -> str:
        """What to change so that it fits."""
        out = ["lower engines.memory_mb, engines.standby or the batch engines' memory_mb"]
        if not self.allowed and any(r.standbys for r in self.rooms):
            if all(r.fits(True) for r in self.rooms):
                out.insert(0, "set update.free_standby_kv: true (the old standbys stop first)")
            else:
                out.append("set update.free_standby_kv: true and free more")
        out += [
            "hold the new version smaller (--dtype, --quantization)",
            "or give holdfast more memory on the device (devices.capacity_mb, where set)",
        ]
        return ", ".join(out)

    def refusal(self) -> str:
        """Why an update is refused: the numbers of each device where it does not fit,
        and what to change."""
        tight = [r.line(self.give_up) for r in self.rooms if not r.fits(self.give_up)]
        return (
            f"the new version's pool does not fit beside the pool that serves: "
            f"{'; '.join(tight)}; {self.fixes()}"
        )

    def summary(self) -> str:
        """One line for the update's reply."""
        head = "memory: two pools fit"
        if self.give_up:
            head += " once the old standbys stop (update.free_standby_kv)"
        return f"{head}: {'; '.join(self.lines())}"


async def for_update(
    c: Crew,
    serving: CacheDaemons,
    model: Path,
    dtype: str,
    quantization: str,
    *,
    new_engines: bool = True,
) -> Verdict:
    """Whether the pool of `model` (as `dtype`/`quantization`) fits beside `serving`'s
    with the crew's engines and the new version's (none for a refit: `new_engines`
    False); ControlError (the numbers, what to change) when it does not. The crew is read
    here, the headers and devices off the loop."""
    p = c.policy
    running = [
        Running(e.name, _engine_bytes(e.memory_mb, e.command, p), _old_standby(c, e))
        for e in c.engines.values()
        if e.running
    ]
    pools = {d.rank: d.pool_bytes for d in serving.daemons}
    try:
        verdict = await asyncio.to_thread(
            _for_update, p, running, pools, model, dtype, quantization, new_engines
        )
    except CacheError as e:
        raise ControlError(f"--model: {model} cannot be sized: {e}") from e
    if not verdict.fits:
        raise ControlError(verdict.refusal())
    return verdict


class Running(msgspec.Struct, frozen=True):
    """An engine that runs, as the memory check counts it."""

    name: str
    rank_bytes: int | None  # on each of its ranks' devices; None: not known
    old_standby: bool  # a standby of the served version


def _for_update(
    p: Policy,
    running: list[Running],
    pools: dict[int, int],
    model: Path,
    dtype: str,
    quantization: str,
    new_engines: bool = True,
) -> Verdict:
    one = (_new_engines(p) or 0) if new_engines else 0
    engines = sum(e.rank_bytes or 0 for e in running)
    standbys = sum(e.rank_bytes or 0 for e in running if e.old_standby)
    rooms = []
    for device, ranks in _ranks(p).items():
        on = len(ranks)
        serving = sum(pools.get(r, 0) for r in ranks)
        held = serving + engines * on  # in use now: not among what the device has free

        def free_and_held(cap: Capacity, held: int = held) -> int:
            return cap.free + held

        room, why = _room(p, device, free_and_held, "free now + what holdfast holds")
        new_pool = _pools(p, model, dtype, quantization, ranks)
        new = one * _serving_count(p) * on
        rooms.append(
            Room(device, ranks, serving, new_pool, engines * on, new, standbys * on, room, why)
        )
    unknown = tuple(e.name for e in running if e.rank_bytes is None)
    return Verdict(tuple(rooms), p.update.free_standby_kv, unknown)


def for_policy(p: Policy, model: Path) -> Verdict:
    """`supervisor validate`'s answer: whether a policy's crew can be updated in place, to
    a pool of its own checkpoint's size, within each device's total."""
    one = _new_engines(p)
    serving = (one or 0) * _serving_count(p)
    standbys = (one or 0) * p.engines.standby
    batch = [
        (b.name, _engine_bytes(b.memory_mb, b.command or p.engines.command, p), b.count)
        for b in p.engines.batch
    ]
    engines = serving + sum((bytes_ or 0) * n for _, bytes_, n in batch)
    rooms = []
    for device, ranks in _ranks(p).items():
        on = len(ranks)
        pool = _pools(p, model, p.model.dtype, p.model.quantization, ranks)
        room, why = _room(p, device, _total, "total")
        rooms.append(
            Room(device, ranks, pool, pool, engines * on, serving * on, standbys * on, room, why)
        )
    unknown = ["the serving engines"] if one is None else []
    unknown += [f"batch engines {name}-*" for name, b, n in batch if b is None and n]
    return Verdict(tuple(rooms), p.update.free_standby_kv, tuple(unknown))


def report(p: Policy, model: Path | None) -> list[str]:
    """`supervisor validate`'s lines on an update's memory, for a policy that loaded."""
    if model is None:
        return [
            f"update memory: not checked: model.preset {p.model.preset} is not generated yet "
            "(`supervisor run` generates it)"
        ]
    try:
        verdict = for_policy(p, model)
    except (CacheError, OSError) as e:
        return [f"update memory: not checked: {model} cannot be sized ({e})"]
    if verdict.fits:
        head = "two pools fit"
        if verdict.give_up:
            head += " once the old standbys stop (update.free_standby_kv)"
    else:
        head = f"two pools do not fit: `supervisor update` is refused; {verdict.fixes()}"
    return [f"update memory: {head}", *(f"  {line}" for line in verdict.lines())]


def _ranks(p: Policy) -> dict[str, tuple[int, ...]]:
    """Each device's ranks (two ranks may share one: `[cpu, cpu]`)."""
    out: dict[str, tuple[int, ...]] = {}
    for rank, device in enumerate(p.devices.ids):
        out[device] = (*out.get(device, ()), rank)
    return out


def _serving_count(p: Policy) -> int:
    return p.engines.primary + p.engines.standby


def _new_engines(p: Policy) -> int | None:
    """A rank's bytes of one serving engine (the policy's primary or a standby)."""
    return _engine_bytes(p.engines.memory_mb, p.engines.command, p)


def _engine_bytes(memory_mb: int, command: Iterable[str], p: Policy) -> int | None:
    """A rank's bytes of one engine: its memory_mb, else the KV cache its command's flags
    or engines.env ask for; None when neither says."""
    if memory_mb > 0:
        return memory_mb * MB
    argv = list(command)
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag in KV_FLAGS:
            value = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            if value.isdigit():
                return int(value) * KV_FLAGS[flag]
    for name, unit in KV_ENV.items():
        value = p.engines.env.get(name, "")
        if value.isdigit():
            return int(value) * unit
    return None


def _pools(p: Policy, model: Path, dtype: str, quantization: str, ranks: Iterable[int]) -> int:
    """The bytes of `ranks`' pools of `model`, from its headers (CacheError if unreadable)."""
    return sum(
        pool_bytes(
            model,
            LoadOptions(dtype, p.model.tp_size, r, quantization, p.devices.ids[r]),
            p.cache.backend,
        )
        for r in ranks
    )


def _total(cap: Capacity) -> int:
    return cap.total


def _room(
    p: Policy, device: str, pick: Callable[[Capacity], int], what: str
) -> tuple[int | None, str]:
    """The bytes holdfast may hold on `device` (`pick` of what it has), and whence."""
    if p.devices.capacity_mb > 0:
        return p.devices.capacity_mb * MB, "devices.capacity_mb"
    try:
        cap = of_device(device)
    except CapacityUnknown as e:
        return None, str(e)
    return pick(cap), f"{what}, {cap.source}"


def _mb(n: int) -> str:
    return f"{n / MB:.1f} MB"


def _old_standby(c: Crew, e: Engine) -> bool:
    """A standby of the served version ("": not started yet, on the served pool then)."""
    return e.serving and e.version in (c.version, "") and e is not c.primary


def standbys_missing(c: Crew) -> int:
    """How many standbys of the served version the policy asks for beyond those in the
    crew (the old standbys an update stopped for room, update.free_standby_kv)."""
    have = [e for e in c.engines.values() if _old_standby(c, e)]
    return max(0, c.policy.engines.standby - len(have))


async def stop_standbys(c: Crew) -> list[str]:
    """Stop the served version's standbys and take them out of the crew, their memory
    given back for the new pool (update.free_standby_kv); their names."""
    old = [e for e in c.engines.values() if _old_standby(c, e)]
    for e in old:
        await c.retire(e)
    return [e.name for e in old]
