"""An engine's KV cache held outside its process (`--kv-share KEEPER`), so that the
standby promoted after its death goes on with its streams from their keys and values:
nothing of what a client was sent is prefilled again.

The primary's cache lives in a memfd, and beside it a ledger, a second memfd: for each
request running, its stream's key (the router's, `holdfast_kv`), the token ids of the
positions whose keys and values are complete, and its block table. Both are deposited
with the keeper (cachedaemon/keeper.py, in the supervisor) under `kv/<engine name>`, so
they outlive the engine. The ledger is written after each step's tokens are recorded:
on the CPU a step has finished writing its keys and values when it returns, so what the
ledger names is never half-written. It has two slots; a write fills the one not current,
then makes it current, so a writer killed halfway leaves the last whole ledger.

A standby keeps a KV cache of STANDBY_TOKENS only (warm-up and probes) while it stands
by. Promoted after the primary's death (`Promote.kv` names that primary's key), it
takes the dead engine's cache and ledger (held ahead, engine/kvahead.py, or else
reclaimed from the keeper then) and `adopt`s them: the
layout (shapes, dtype, model) must be its own, and the process that wrote them must run
no user code any more (killed, exiting or gone, as the supervisor's fence sees it:
holdfast_contract/procfs.py), else it is not adopted. Each ledger
entry becomes a kept prefix under the stream's key (engine/scheduler.py), which the
router's continuation names. Whatever stands in the way, the promoted engine takes a
fresh cache of its own and the continuations prefill (the router's token replay).

Besides the streams, the ledger names every block a step may write (`held`): it is
written again before a step whose blocks it does not name yet. An adopter keeps those
blocks from use until the dead engine's exit is over (`holdfast_contract.procfs.has_exited`):
on a GPU a killed process's last step may still be running on the device until its
context is torn down, so nothing new is written where that step writes.

On a GPU (one rank) the cache is one VMM allocation exported as an fd, mapped into an
address range of its own by each engine (engine/kvcuda.py): a standby maps its few pages
there and captures its CUDA graphs over the range; promoted, it maps the adopted
allocation over the whole range, and the graphs replay on it. Ledger writes follow a
step's device synchronize, so what it names is written on the device too.
"""

from __future__ import annotations

import mmap
import os
import struct
import time

import msgspec
import structlog
import torch

from engine.errors import EngineError
from engine.job import Step
from engine.kvahead import Ahead
from engine.kvcache import KVCache
from engine.kvcuda import CudaSpace, standby_spans
from engine.scheduler import LEDGER_STEPS
from holdfast_contract.agent_protocol import kv_key
from holdfast_contract.procfs import has_exited, runs_user_code
from holdfast_contract.ready import start_time

log = structlog.get_logger("engine.kvshare")
MAGIC = b"HFKVLDG2"
HEADER = 4096  # magic, the current slot, both slots' lengths, the meta
_HEAD = struct.Struct("<8sQQQI")  # magic, current slot + 1 (0: none), len 0, len 1, meta len
STANDBY_TOKENS = 256  # a standby's own cache while it stands by: warm-up and probes
WRITER_GONE_S = 2.0  # how long adoption waits for the dead engine's process to be killed


class Layout(msgspec.Struct, frozen=True):
    """What a cache's bytes mean: two engines with equal layouts read them alike."""

    layers: int
    blocks: int  # usable blocks; one more is scratch
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: str
    model: str  # whose keys and values: the checkpoint dir, dtype, quantization

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.layers, self.blocks + 1, self.block_size, self.kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        """One block of one layer's keys (or values)."""
        item = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return self.block_size * self.kv_heads * self.head_dim * item

    @property
    def tensor_bytes(self) -> int:
        return self.layers * (self.blocks + 1) * self.block_bytes


class Meta(msgspec.Struct, frozen=True):
    layout: Layout
    pid: int  # the process writing the cache and ledger now
    start_time: int | None


class Entry(msgspec.Struct, frozen=True, array_like=True):
    key: str  # the stream's, as the router names it
    tokens: list[int]  # the ids of the positions whose keys and values are complete
    blocks: list[int]  # its block table
    # the steps of its last tokens sampled (LEDGER_STEPS at most): the last one's token
    # comes after `tokens`, its keys and values not written yet; the others sampled the
    # last of `tokens`
    recent: list[Step] = []

    @property
    def sampled(self) -> Step | None:
        """The last token sampled: after `tokens`, its keys and values not written yet."""
        return self.recent[-1] if self.recent else None


class Slot(msgspec.Struct, frozen=True, array_like=True):
    """One ledger write: the streams, and every block a step may write now."""

    entries: list[Entry]
    held: list[int]


class NotAdopted(Exception):
    """Why a dead engine's KV cache is not taken over (the continuations replay instead)."""


def supported(device: torch.device, world_size: int) -> str:
    """'' if a cache on `device` can be shared, else why not."""
    if world_size != 1:
        return "a tensor-parallel engine keeps its KV cache private"
    if device.type == "cuda":
        from cachedaemon import cuda_driver

        if not cuda_driver.available():
            return f"a KV cache on {device} is shared through cuda-bindings, which is missing"
        return ""
    if device.type != "cpu":
        return f"a KV cache on {device} is kept private (sharing it needs a CPU or CUDA device)"
    return ""


class SharedKV:
    """A KV cache and its ledger: a memfd mapped here, or on a GPU a VMM allocation mapped
    into `space` (by the caller); the ledger a memfd either way."""

    def __init__(self, kv_fd: int, ledger_fd: int, space: CudaSpace | None = None) -> None:
        self.fds = [kv_fd, ledger_fd]
        self.space = space
        self._kv = mmap.mmap(kv_fd, os.fstat(kv_fd).st_size) if space is None else None
        self._ledger = mmap.mmap(ledger_fd, os.fstat(ledger_fd).st_size)
        if self._ledger.size() < HEADER:
            raise NotAdopted("its ledger is shorter than a header")
        self._slot = (self._ledger.size() - HEADER) // 2
        self.meta = self._read_meta()

    @classmethod
    def create(
        cls, layout: Layout, max_batch: int, max_len: int, space: CudaSpace | None = None
    ) -> SharedKV:
        """A new cache (on the CPU zeroed, as memfd pages are; on a GPU mapped over
        `space`) and an empty ledger, written by us."""
        ledger = os.memfd_create("holdfast-kv-ledger", os.MFD_CLOEXEC)
        if space is None:
            kv = os.memfd_create("holdfast-kv", os.MFD_CLOEXEC)
            os.ftruncate(kv, 2 * layout.tensor_bytes)
        else:
            try:
                kv = space.map_whole(None)
            except EngineError:
                os.close(ledger)
                raise
        # a slot holds every running request's ids and blocks, msgpack'd (<= 5 bytes each),
        # and the steps of its last tokens (a token, its logprob and 5 alternatives)
        per = max_len + 2 * (max_len // layout.block_size) + 64 + LEDGER_STEPS * 32
        os.ftruncate(ledger, HEADER + 2 * max(1 << 20, 5 * max_batch * per))
        with mmap.mmap(ledger, HEADER) as head:
            _HEAD.pack_into(head, 0, MAGIC, 0, 0, 0, 0)
            _write_meta(head, Meta(layout, os.getpid(), start_time(os.getpid())))
        return cls(kv, ledger, space)

    # ---- the cache ----
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys' and values' tensors, views of the memfd (or the GPU range)."""
        lay = self.meta.layout
        return split(self._raw(), lay)

    def _raw(self) -> torch.Tensor:
        if self.space is not None:
            return self.space.raw()
        assert self._kv is not None
        return torch.frombuffer(
            self._kv, dtype=torch.uint8, count=2 * self.meta.layout.tensor_bytes
        )

    # ---- the ledger ----
    def write(self, entries: list[Entry], held: list[int]) -> bool:
        """Make `entries` and `held` (every block a step may write now) the ledger: into
        the slot not current, then that slot current. False (the ledger left as it was)
        if they do not fit a slot."""
        data = _encoder.encode(Slot(entries, held))
        if len(data) > self._slot:
            return False
        current = _HEAD.unpack_from(self._ledger, 0)[1]
        slot = 1 if current == 1 else 0  # current is slot + 1: write the other one
        at = HEADER + slot * self._slot
        self._ledger[at : at + len(data)] = data
        struct.pack_into("<Q", self._ledger, 16 + 8 * slot, len(data))
        struct.pack_into("<Q", self._ledger, 8, slot + 1)  # one aligned store: the switch
        return True

    def read(self) -> Slot:
        _, current, len0, len1, _ = _HEAD.unpack_from(self._ledger, 0)
        if current not in (1, 2):
            return Slot([], [])
        at = HEADER + (current - 1) * self._slot
        n = (len0, len1)[current - 1]
        try:
            return _decoder.decode(self._ledger[at : at + n])
        except msgspec.DecodeError as e:
            raise NotAdopted(f"its ledger does not decode: {e}") from None

    def _read_meta(self) -> Meta:
        magic, _, _, _, meta_len = _HEAD.unpack_from(self._ledger, 0)
        if magic != MAGIC or not 0 < meta_len <= HEADER - _HEAD.size:
            raise NotAdopted("its ledger has no header")
        try:
            return _meta_decoder.decode(self._ledger[_HEAD.size : _HEAD.size + meta_len])
        except msgspec.DecodeError as e:
            raise NotAdopted(f"its ledger's header does not decode: {e}") from None

    def _claim(self, layout: Layout) -> Meta:
        """This process writes the cache and ledger from now on."""
        meta = Meta(layout, os.getpid(), start_time(os.getpid()))
        _write_meta(self._ledger, meta)
        return meta

    def close(self) -> None:
        """Close the fds (what is mapped stays mapped)."""
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def split(raw: torch.Tensor, lay: Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys' and values' tensors of `lay` from `raw`'s bytes (keys first)."""
    dtype = getattr(torch, lay.dtype)
    n = lay.tensor_bytes
    return raw[:n].view(dtype).view(lay.shape), raw[n : 2 * n].view(dtype).view(lay.shape)


def _write_meta(ledger: mmap.mmap, meta: Meta) -> None:
    data = msgspec.msgpack.encode(meta)
    if len(data) > HEADER - _HEAD.size:
        raise EngineError("the KV ledger's header does not fit: the model path is too long")
    ledger[_HEAD.size : _HEAD.size + len(data)] = data
    struct.pack_into("<I", ledger, _HEAD.size - 4, len(data))


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Slot)
_meta_decoder = msgspec.msgpack.Decoder(Meta)


class Adopted(msgspec.Struct):
    """A dead engine's cache taken over: its streams, and the blocks its last step may
    still write (`held`, none of the streams'), to keep from use until `writer` has exited."""

    shared: SharedKV
    entries: list[Entry]
    held: list[int]
    writer: tuple[int, int | None]  # its pid and start time

    def place(self) -> None:
        """On a GPU, map the cache into its space (what the standby mapped there goes):
        NotAdopted if it does not map. Nothing to do on the CPU."""
        space = self.shared.space
        if space is not None:
            try:
                space.map_whole(self.shared.fds[0])
            except EngineError as e:
                raise NotAdopted(str(e)) from None


def adopt(
    fds: list[int], want: Layout, space: CudaSpace | None = None, *, place: bool = True
) -> Adopted:
    """Take over a dead engine's cache and ledger (`fds`, ours to keep): NotAdopted if
    they are not for `want`, if the ledger is not whole, or if the engine that wrote them
    may still run user code after WRITER_GONE_S (two engines never write one cache):
    killed (SIGKILL pending), exiting or gone, it writes nothing more, and its memory's
    teardown is not waited for. On a GPU the cache is mapped into `space` last, once all
    else is checked (what the standby mapped there goes); with `place` False it is not
    mapped here, and the caller maps it (`Adopted.place`) before anything reads it."""
    try:
        shared = SharedKV(fds[0], fds[1], space=space)
    except (OSError, ValueError, TypeError) as e:
        for fd in fds:
            os.close(fd)
        raise NotAdopted(f"its cache does not map: {e}") from None
    except NotAdopted:
        for fd in fds:
            os.close(fd)
        raise
    try:
        meta = shared.meta
        if meta.layout != want:
            raise NotAdopted(f"its layout {meta.layout} is not this engine's {want}")
        if space is None and os.fstat(shared.fds[0]).st_size < 2 * want.tensor_bytes:
            raise NotAdopted("its cache is shorter than its layout")
        deadline = time.monotonic() + WRITER_GONE_S
        while runs_user_code(meta.pid, meta.start_time):
            if meta.pid == os.getpid():
                raise NotAdopted("it is this engine's own")
            if time.monotonic() > deadline:
                raise NotAdopted(f"the engine that writes it (pid {meta.pid}) still runs")
            time.sleep(0.001)
        slot = shared.read()
        held = check(slot, want)
        took = Adopted(shared, slot.entries, held, (meta.pid, meta.start_time))
        if place:
            took.place()
        shared.meta = shared._claim(want)
        return took
    except NotAdopted:
        shared.close()
        raise


def check(slot: Slot, layout: Layout) -> list[int]:
    """Every stream's block named once, inside the cache, and enough of them for the
    tokens; every held block inside the cache. The held blocks no stream names."""
    seen: set[int] = set()
    for e in slot.entries:
        if len(e.blocks) * layout.block_size < len(e.tokens):
            raise NotAdopted(f"stream {e.key}: {len(e.tokens)} tokens in {len(e.blocks)} blocks")
        for b in e.blocks:
            if not 0 <= b < layout.blocks or b in seen:
                raise NotAdopted(f"stream {e.key}: block {b} is outside the cache or named twice")
            seen.add(b)
    held = sorted(set(slot.held) - seen)
    if held and not (held[0] >= 0 and held[-1] < layout.blocks):
        raise NotAdopted(f"its ledger holds a block outside the cache ({held[0]}..{held[-1]})")
    return held


def wait_exited(writer: tuple[int, int | None], limit_s: float) -> bool:
    """Whether the process `writer` (pid, start time) has exited within `limit_s`."""
    deadline = time.monotonic() + limit_s
    while not has_exited(*writer):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


class Home:
    """Where an engine keeps its shared cache: the keeper at `keeper`, under `kv/<name>`;
    and what the cache is (`layout`, from `budget_mb`, on `device`)."""

    def __init__(
        self,
        keeper: str,
        name: str,
        layout: Layout,
        budget_mb: int,
        max_batch: int,
        max_len: int,
        device: torch.device | None = None,
    ) -> None:
        self.keeper, self.key = keeper, kv_key(name)
        self.layout, self.budget_mb = layout, budget_mb
        self.max_batch, self.max_len = max_batch, max_len
        self.device = device if device is not None else torch.device("cpu")
        # on a GPU: the one address range every cache of this engine is mapped into
        self._space: CudaSpace | None = None
        # a standby's: the primaries' caches held ahead of a promotion (engine/kvahead.py)
        self.ahead: Ahead | None = None

    def hold_ahead(self) -> None:
        """A standby holds every primary's cache the keeper keeps, until it is promoted."""
        if self.ahead is None:
            self.ahead = Ahead(self.keeper, self.key)
            self.ahead.start()

    @property
    def space(self) -> CudaSpace | None:
        if self.device.type == "cuda" and self._space is None:
            self._space = CudaSpace(self.device, self.layout.tensor_bytes)
        return self._space

    def standby_cache(self, tokens: int) -> KVCache:
        """A standby's own cache while it stands by: room for `tokens` (and scratch). On a
        GPU it has the whole cache's shape, in the range a cache it takes later is mapped
        into, with memory under only the blocks it uses."""
        lay = self.layout
        usable = min(lay.blocks, -(-tokens // lay.block_size))
        space = self.space
        if space is None:
            per = 2 * lay.layers * lay.block_bytes
            mb = min(self.budget_mb, -(-(per * (usable + 1)) // (1 << 20)))
            dtype = getattr(torch, lay.dtype)
            return KVCache(lay.layers, lay.kv_heads, lay.head_dim, mb, dtype, "cpu", lay.block_size)
        space.map_pages(
            standby_spans(lay.layers, lay.blocks, lay.block_bytes, usable, lay.tensor_bytes)
        )
        return self._cache(split(space.raw(), lay), usable)

    def new(self) -> SharedKV:
        """A new cache of our own, not deposited yet."""
        return SharedKV.create(self.layout, self.max_batch, self.max_len, self.space)

    def fresh(self, *, primary: bool) -> SharedKV:
        """A new cache of our own, deposited (a keeper that does not answer: logged, and
        the cache is ours alone); `primary`: this engine serves as the primary."""
        shared = self.new()
        self.deposit(shared, primary=primary)
        return shared

    def cache(self, shared: SharedKV) -> KVCache:
        """A KV cache on `shared`'s tensors."""
        return self._cache(shared.tensors(), None)

    def _cache(self, tensors: tuple[torch.Tensor, torch.Tensor], usable: int | None) -> KVCache:
        lay = self.layout
        dtype = getattr(torch, lay.dtype)
        return KVCache(
            lay.layers,
            lay.kv_heads,
            lay.head_dim,
            self.budget_mb,
            dtype,
            self.device,
            lay.block_size,
            tensors=tensors,
            usable=usable,
        )

    def deposit(self, shared: SharedKV, *, primary: bool) -> None:
        """`shared` into the keeper under our key; a primary's is held by the standbys
        ahead of a promotion (engine/kvahead.py)."""
        from cachedaemon import protocol
        from cachedaemon.errors import CacheError
        from holdfast_contract.errors import ProtocolError

        msg = protocol.DepositKV(self.key, primary=primary)
        try:
            reply, fds = protocol.call(self.keeper, msg, shared.fds)
        except (CacheError, ProtocolError, OSError) as e:
            log.warning("kv cache not deposited", keeper=self.keeper, error=str(e))
            return
        for fd in fds:
            os.close(fd)
        if not isinstance(reply, protocol.Ok):
            log.warning("kv cache not deposited", keeper=self.keeper, reply=repr(reply))

    def withdraw(self) -> None:
        """Drop what the keeper holds under our key: a standby starting again under this
        name, whose last incarnation's cache was adopted already, or is no one's."""
        from cachedaemon import protocol
        from cachedaemon.errors import CacheError
        from holdfast_contract.errors import ProtocolError

        try:
            protocol.call(self.keeper, protocol.WithdrawKV(self.key))
        except (CacheError, ProtocolError, OSError) as e:
            log.warning("kv cache not withdrawn", keeper=self.keeper, error=str(e))

    def take_over(self, dead: str, ident: str = "") -> tuple[Adopted, str]:
        """The cache and ledger the keeper holds under `dead` (a dead engine's key),
        adopted and mapped; else a new cache and why not. Not deposited yet (`deposit`).
        On a GPU this maps into the engine's range: the model thread's work."""
        took, why = self.claim(dead, ident)
        return self.place(took, why)

    def let_go(self) -> None:
        """Promoted (or leaving): nothing is held ahead any more."""
        if self.ahead is not None:
            self.ahead.take("", "")

    def claim(self, dead: str, ident: str = "") -> tuple[Adopted | None, str]:
        """The cache and ledger the keeper holds under `dead`, checked and claimed, but on
        a GPU not mapped yet (`place`, on the model thread); None and why not if they
        cannot be adopted. No device work: any thread. `ident`: which cache the keeper
        held under `dead` when the promotion was decided (`Promote.kv_ident`): if that is
        the one held ahead, the keeper is not asked."""
        t0 = time.perf_counter()
        held = self.ahead.take(dead, ident) if self.ahead is not None else None
        try:
            fds = held if held is not None else self._reclaim(dead)
            t1 = time.perf_counter()
            took = adopt(fds, self.layout, self.space, place=False)
        except NotAdopted as e:
            log.warning("kv cache not adopted; continuations prefill", dead=dead, why=str(e))
            return None, str(e)
        log.info(
            "kv cache adopted",
            dead=dead,
            streams=len(took.entries),
            tokens=sum(len(e.tokens) for e in took.entries),
            held=len(took.held),
            ahead=held is not None,  # its fds were held ahead: the keeper was not asked
            reclaim_ms=round((t1 - t0) * 1e3, 2),
            adopt_ms=round((time.perf_counter() - t1) * 1e3, 2),
        )
        return took, ""

    def place(self, took: Adopted | None, why: str = "") -> tuple[Adopted, str]:
        """`took` mapped into the engine's range (on a GPU; where no step runs); where it
        is None or does not map, a new cache of our own, and why not."""
        if took is not None:
            t0 = time.perf_counter()
            try:
                took.place()
            except NotAdopted as e:
                took.shared.close()
                why = str(e)
                log.warning("kv cache not adopted; continuations prefill", why=why)
            else:
                if self.space is not None:
                    ms = round((time.perf_counter() - t0) * 1e3, 2)
                    log.info("kv cache mapped", ms=ms, **self.space.timings)
                return took, ""
        return Adopted(self.new(), [], [], (0, None)), why

    def _reclaim(self, key: str) -> list[int]:
        from cachedaemon import protocol
        from cachedaemon.errors import CacheError
        from holdfast_contract.errors import ProtocolError

        try:
            reply, fds = protocol.call(self.keeper, protocol.ReclaimKV(key), max_fds=2)
        except (CacheError, ProtocolError, OSError) as e:
            raise NotAdopted(f"the keeper at {self.keeper} does not answer: {e}") from None
        if not isinstance(reply, protocol.KVReclaimed) or len(fds) != 2:
            for fd in fds:
                os.close(fd)
            raise NotAdopted(f"the keeper holds no KV cache under {key}")
        return fds
