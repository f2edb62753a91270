"""Frame generators and drivers for fuzzing the socket protocols against live servers.

Hypothesis draws a few dozen structured messages per example (real message types with right
or wrong fields, values, types and tags); a seeded `random.Random` from the same example
turns them into a few hundred frames on several connections: whole frames, frames split at
random points and written interleaved across connections, truncated frames, garbage bodies,
oversized length prefixes, fds riding on SCM_RIGHTS, graceful and abrupt closes.
"""

from __future__ import annotations

import contextlib
import os
import random
import selectors
import socket
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from hypothesis import strategies as st

U64 = 2**64 - 1
HEADER = struct.Struct(">I")

# ---- message strategies -------------------------------------------------------------------

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), U64),
    st.floats(),
    st.text(max_size=8),
    st.binary(max_size=8),
)
anything = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=4,
)
ints = st.one_of(
    st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, 2**32, 2**63 - 1, U64, -(2**63)]),
    st.integers(-(2**63), U64),
)


def right(t: msgspec.inspect.Type, names: st.SearchStrategy[str]) -> st.SearchStrategy[Any]:
    """Plain values (dicts for structs) of the right type for `t`; names for str fields."""
    mi = msgspec.inspect
    if isinstance(t, mi.IntType):
        return ints
    if isinstance(t, mi.StrType):
        return names
    if isinstance(t, mi.FloatType):
        return st.floats()
    if isinstance(t, mi.BoolType):
        return st.booleans()
    if isinstance(t, mi.NoneType):
        return st.none()
    if isinstance(t, (mi.ListType, mi.VarTupleType)):
        return st.lists(right(t.item_type, names), max_size=2)
    if isinstance(t, mi.TupleType):
        return st.tuples(*(right(i, names) for i in t.item_types)).map(list)
    if isinstance(t, mi.DictType):
        return st.dictionaries(right(t.key_type, names), right(t.value_type, names), max_size=2)
    if isinstance(t, mi.UnionType):
        return st.one_of(*(right(i, names) for i in t.types))
    if isinstance(t, mi.StructType):
        return struct_dict(t, names)
    return anything


def struct_dict(t: msgspec.inspect.StructType, names: st.SearchStrategy[str]) -> Any:
    fields = {f.encode_name: right(f.type, names) for f in t.fields}
    optional = {f.encode_name for f in t.fields if not f.required}
    base = st.fixed_dictionaries(fields).flatmap(
        lambda d: st.sets(st.sampled_from(sorted(optional)) if optional else st.nothing()).map(
            lambda drop: {k: v for k, v in d.items() if k not in drop}
        )
    )
    if t.tag_field is not None:
        return base.map(lambda d: {t.tag_field: t.tag, **d})
    return base


def wrong(d: Any, tags: Sequence[str]) -> st.SearchStrategy[Any]:
    """`d` (a message as a dict) made wrong: a field dropped, added or of another type, an
    unknown or another message's tag, or no dict at all."""
    if not isinstance(d, dict) or not d:
        return anything
    keys = sorted(d)
    return st.one_of(
        st.sampled_from(keys).map(lambda k: {x: v for x, v in d.items() if x != k}),
        st.tuples(st.text(max_size=6), anything).map(lambda kv: {**d, kv[0]: kv[1]}),
        st.tuples(st.sampled_from(keys), anything).map(lambda kv: {**d, kv[0]: kv[1]}),
        st.one_of(st.sampled_from(list(tags)), st.text(max_size=10)).map(
            lambda tag: {**d, "type": tag}
        ),
        anything,
    )


def messages(types: Sequence[type], names: st.SearchStrategy[str]) -> st.SearchStrategy[Any]:
    """A message of one of `types` as a plain value: right, or made wrong."""
    infos = [msgspec.inspect.type_info(t) for t in types]
    tags = [str(i.tag) for i in infos if isinstance(i, msgspec.inspect.StructType)]
    ok = st.one_of(
        *(struct_dict(i, names) for i in infos if isinstance(i, msgspec.inspect.StructType))
    )
    return st.one_of(ok, ok, ok.flatmap(lambda d: wrong(d, tags)))


def encode(value: Any) -> bytes:
    return msgspec.msgpack.encode(value)


# ---- counts -------------------------------------------------------------------------------


@dataclass
class Counts:
    frames: int = 0
    connections: int = 0
    fds: int = 0
    replies: int = 0
    good: int = 0

    def line(self, name: str, seconds: float) -> str:
        return (
            f"{name}: {self.frames} frames, {self.connections} connections, {self.fds} fds "
            f"passed, {self.replies} replies read, {self.good} good-client calls, "
            f"{seconds:.1f} s"
        )


# ---- length-prefixed stream connections ---------------------------------------------------


@dataclass
class Plan:
    """One connection: pieces written in order (fds ride on a piece's first byte), then
    a graceful half-close that reads every reply, or an abrupt close."""

    pieces: list[tuple[bytes, int]] = field(default_factory=list)  # (bytes, number of fds)
    abrupt: bool = False
    reset: bool = False  # abrupt with SO_LINGER 0: a RST, not a FIN


def split(frame: bytes, rnd: random.Random, fds: int, fds_mid: bool) -> list[tuple[bytes, int]]:
    """`frame` in 1-3 pieces; its fds on the first piece, or on a later one (`fds_mid`)."""
    cuts = sorted(rnd.sample(range(1, len(frame)), min(len(frame) - 1, rnd.choice((0, 0, 1, 2)))))
    bounds = [0, *cuts, len(frame)]
    pieces = [frame[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    at = len(pieces) - 1 if fds_mid and len(pieces) > 1 else 0
    return [(p, fds if i == at else 0) for i, p in enumerate(pieces)]


def bad_frame(rnd: random.Random, body: bytes, max_frame: int) -> bytes:
    """A frame that ends its connection: truncated, garbage, or an oversized prefix."""
    kind = rnd.randrange(5)
    whole = HEADER.pack(len(body)) + body
    if kind == 0:  # truncated: header and part of the body, or part of the header
        return whole[: rnd.randrange(1, len(whole))]
    if kind == 1:  # garbage body of the announced length
        junk = rnd.randbytes(rnd.randrange(1, 64))
        return HEADER.pack(len(junk)) + junk
    if kind == 2:  # oversized prefix
        return HEADER.pack(rnd.choice((max_frame + 1, 2**31, 2**32 - 1))) + body
    if kind == 3:  # a prefix longer than what follows
        return HEADER.pack(len(body) + rnd.randrange(1, 4096)) + body
    flipped = bytearray(whole)  # a flipped byte anywhere, header included
    i = rnd.randrange(len(flipped))
    flipped[i] ^= 1 << rnd.randrange(8)
    return bytes(flipped)


class StreamFuzzer:
    """Drives many `Plan`s at once against a unix socket, interleaving their writes."""

    def __init__(self, path: str, fd_pool: Sequence[int], counts: Counts, timeout: float = 60.0):
        self.path = path
        self.fd_pool = list(fd_pool)
        self.counts = counts
        self.timeout = timeout

    def run(self, plans: list[Plan], at_once: int = 12) -> None:
        sel = selectors.DefaultSelector()
        waiting = list(reversed(plans))
        open_: dict[socket.socket, list[Any]] = {}
        deadline = time.monotonic() + self.timeout
        try:
            while waiting or open_:
                while waiting and len(open_) < at_once:
                    plan = waiting.pop()
                    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    s.settimeout(self.timeout)
                    s.connect(self.path)
                    s.setblocking(False)
                    self.counts.connections += 1
                    open_[s] = [plan, 0, 0]  # plan, next piece, offset in it
                    sel.register(s, selectors.EVENT_READ | selectors.EVENT_WRITE)
                if time.monotonic() > deadline:
                    raise AssertionError(f"{self.path}: {len(open_)} connections never finished")
                for key, ev in sel.select(timeout=1.0):
                    s = key.fileobj
                    assert isinstance(s, socket.socket)
                    gone = ev & selectors.EVENT_READ and not self._read(s)
                    if gone or (ev & selectors.EVENT_WRITE and not self._write(sel, open_, s)):
                        self._drop(sel, open_, s)
        finally:
            for s in list(open_):
                self._drop(sel, open_, s)
            sel.close()

    def _read(self, s: socket.socket) -> bool:
        try:
            data = s.recv(1 << 16)  # fds sent to us without a control buffer are dropped
        except BlockingIOError:
            return True
        except OSError:
            return False
        self.counts.replies += bool(data)
        return bool(data)

    def _write(
        self, sel: selectors.BaseSelector, open_: dict[socket.socket, list[Any]], s: socket.socket
    ) -> bool:
        state = open_[s]
        plan, i, off = state
        if i == len(plan.pieces):
            if plan.abrupt:
                if plan.reset:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                return False
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_WR)
            sel.modify(s, selectors.EVENT_READ)
            return True
        piece, nfds = plan.pieces[i]
        try:
            if off == 0 and nfds:
                fds = random.Random(len(piece) + i).sample(self.fd_pool, nfds)
                sent = socket.send_fds(s, [piece], fds)
                self.counts.fds += nfds
            else:
                sent = s.send(piece[off:])
        except BlockingIOError:
            return True
        except OSError:  # the server closed on a bad frame: what is left is not sent
            return False
        off += sent
        state[1:] = [i + 1, 0] if off >= len(piece) else [i, off]
        return True

    @staticmethod
    def _drop(
        sel: selectors.BaseSelector, open_: dict[socket.socket, list[Any]], s: socket.socket
    ) -> None:
        if s in open_:
            del open_[s]
            sel.unregister(s)
            s.close()


def stream_plans(
    rnd: random.Random,
    bodies: list[bytes],
    decodes: Callable[[bytes], bool],
    counts: Counts,
    *,
    frames: int,
    max_frame: int,
    max_fds: int,
    per_conn: tuple[int, int] = (1, 60),
) -> list[Plan]:
    """About `frames` frames from `bodies` in connections of `per_conn` frames that the
    server reads (bodies it decodes), each maybe ended by one frame it cannot read."""
    good = [b for b in bodies if decodes(b)] or [b"\x80"]
    plans: list[Plan] = []
    made = 0
    while made < frames:
        plan = Plan()
        for _ in range(rnd.randint(*per_conn)):
            body = rnd.choice(good)
            nfds = rnd.choice((0, 0, 0, 1, 2, 3)) if max_fds >= 0 else 0
            plan.pieces += split(HEADER.pack(len(body)) + body, rnd, nfds, rnd.random() < 0.1)
            made += 1
        if rnd.random() < 0.7:  # end with what cannot be read: undecodable or malformed
            body = rnd.choice(bodies)
            frame = (
                HEADER.pack(len(body)) + body
                if not decodes(body)
                else bad_frame(rnd, body, max_frame)
            )
            plan.pieces += split(frame, rnd, rnd.choice((0, 0, 1)), False)
            made += 1
        plan.abrupt = rnd.random() < 0.3
        plan.reset = plan.abrupt and rnd.random() < 0.5
        plans.append(plan)
    counts.frames += made
    return plans


# ---- fds ----------------------------------------------------------------------------------


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def settled_fds(pid: int, target: int, timeout: float = 20.0) -> int:
    """The process's fd count once it is at most `target`, or its last count at `timeout`."""
    deadline = time.monotonic() + timeout
    n = fd_count(pid)
    while n > target and time.monotonic() < deadline:
        time.sleep(0.05)  # polls /proc: there is no notification of an fd being closed
        n = fd_count(pid)
    return n


def open_fd_pool(tmp: str) -> list[int]:
    """Fds of several kinds to pass: /dev/null, a pipe's ends, a memfd, a socket, a dir."""
    r, w = os.pipe()
    a, b = socket.socketpair()
    return [
        os.open(os.devnull, os.O_RDWR),
        r,
        w,
        os.memfd_create("fuzz"),
        a.detach(),
        b.detach(),
        os.open(tmp, os.O_RDONLY | os.O_DIRECTORY),
    ]
