"""Every socket protocol fuzzed against a live server while a well-behaved client works.

Daemon, keeper and fork server run as their own processes; the agents hub and the control
socket are those of a real `supervisor run`. Each gets at least FRAMES generated frames
(see tests/fuzzwire.py for what they are). The server must not die, must hold no more fds
afterwards than before, and the well-behaved client must never see an error. The counts
show in the run's summary (`fuzz:` lines, from tests/conftest.py).
"""

from __future__ import annotations

import os
import random
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from cachedaemon import protocol
from cachedaemon.manifest import ChunkEntry, Manifest
from holdfast_contract import agent_protocol as sp
from holdfast_contract import control as wire_control
from holdfast_contract import forkserver as fs
from holdfast_contract import wire
from holdfast_contract.errors import ProtocolError
from supervisor import control
from tests.conftest import LoggedProc, child_env
from tests.engines.harness import Supervisor, write_policy
from tests.fuzzwire import (
    HEADER,
    Counts,
    Plan,
    StreamFuzzer,
    bad_frame,
    encode,
    fd_count,
    messages,
    open_fd_pool,
    settled_fds,
    split,
    stream_plans,
)

FRAMES = 100_000
EXAMPLES = 200
PER_EXAMPLE = FRAMES // EXAMPLES + 1
PACE = 0.005  # seconds between two calls of the well-behaved client
SEEDS = st.integers(0, 2**32)  # the seed of the frames made from an example's messages


def fuzz_settings(examples: int = EXAMPLES) -> Callable[[Any], Any]:
    return settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,  # the same frames on every run
        suppress_health_check=list(HealthCheck),
        phases=(Phase.explicit, Phase.generate),  # no shrinking against a live server
    )


def record(record_property: Callable[[str, object], None], name: str, c: Counts, t0: float) -> None:
    record_property("fuzz", c.line(name, time.monotonic() - t0))
    assert c.frames >= FRAMES, f"{name}: only {c.frames} frames sent"


class GoodClient:
    """Calls `step` in a thread until stopped; keeps every error it raised."""

    def __init__(self, step: Callable[[], None], counts: Counts) -> None:
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._step = step
        self._counts = counts
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._step()
                self._counts.good += 1
            except Exception as e:  # noqa: BLE001 - every failure is a finding
                self.errors.append(f"{type(e).__name__}: {e}")
                if len(self.errors) > 20:
                    return
            self._stop.wait(PACE)  # leaves the cores to the fuzzing; nothing waits on this

    def stop(self) -> list[str]:
        self._stop.set()
        self._thread.join(60)
        assert not self._thread.is_alive(), "the good client hangs"
        return self.errors


@pytest.fixture
def fd_pool(tmp_path: Path) -> Iterator[list[int]]:
    fds = open_fd_pool(str(tmp_path))
    yield fds
    wire.close_fds(fds)


def decodes_as(decode: Callable[[bytes], object]) -> Callable[[bytes], bool]:
    def ok(body: bytes) -> bool:
        try:
            decode(body)
        except (ProtocolError, msgspec.MsgspecError):
            return False
        return True

    return ok


def fuzz_frame_server(
    path: str, msgs: st.SearchStrategy[Any], fd_pool: list[int], counts: Counts, max_fds: int
) -> None:
    """FRAMES frames at the daemon or keeper protocol on `path`."""
    fuzzer = StreamFuzzer(path, fd_pool, counts)
    stalled = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(3)]
    for s in stalled:  # half a header, then silence for the whole run
        s.connect(path)
        s.sendall(b"\x00\x00")

    @fuzz_settings()
    @given(st.lists(msgs, min_size=4, max_size=12), SEEDS)
    def batch(values: list[Any], seed: int) -> None:
        rnd = random.Random(seed)
        bodies = [encode(v) for v in values]
        plans = stream_plans(
            rnd,
            bodies,
            decodes_as(protocol.decode),
            counts,
            frames=PER_EXAMPLE,
            max_frame=protocol.MAX_FRAME,
            max_fds=max_fds,
        )
        fuzzer.run(plans)

    try:
        batch()
    finally:
        for s in stalled:
            s.close()


# ---- the cache daemon ---------------------------------------------------------------------

DAEMON_TYPES = [
    protocol.Ping,
    protocol.AttachRequest,
    protocol.StatusRequest,
    protocol.Pong,
    protocol.ErrorReply,
    protocol.Withdraw,
    protocol.ListPools,
    protocol.Mismatch,
    protocol.Deposit,
]
KEEPER_TYPES = [
    protocol.Deposit,
    protocol.Reclaim,
    protocol.Withdraw,
    protocol.ListPools,
    protocol.Ping,
    protocol.Ok,
    protocol.NotFound,
    protocol.Pools,
]
fingerprints = st.one_of(st.sampled_from(["fz", "fz-1", ""]), st.text(max_size=6))


def test_daemon_survives_fuzzing(
    tiny_model: Path,
    tmp_path: Path,
    start_daemon: Any,
    fd_pool: list[int],
    record_property: Callable[[str, object], None],
) -> None:
    t0 = time.monotonic()
    run = tmp_path / "run"
    daemon = start_daemon(tiny_model, run)
    path = str(run / "daemon-0.sock")
    pid = daemon.proc.pid
    counts = Counts()

    def attach() -> None:
        reply, fds = protocol.call(path, protocol.AttachRequest(), max_fds=wire.MAX_FDS)
        wire.close_fds(fds)
        if not isinstance(reply, protocol.AttachReply) or len(fds) != len(reply.manifest.chunks):
            raise AssertionError(f"attach answered {reply!r} with {len(fds)} fds")

    attach()
    before = fd_count(pid)
    good = GoodClient(attach, counts)
    fuzz_frame_server(path, messages(DAEMON_TYPES, fingerprints), fd_pool, counts, max_fds=0)
    assert good.stop() == []
    assert daemon.proc.poll() is None, daemon.log[-3000:]
    assert settled_fds(pid, before) <= before, f"the daemon holds {fd_count(pid) - before} fds more"
    attach()
    record(record_property, "daemon", counts, t0)


# ---- the keeper ---------------------------------------------------------------------------


def test_keeper_survives_fuzzing(
    tmp_path: Path, fd_pool: list[int], record_property: Callable[[str, object], None]
) -> None:
    t0 = time.monotonic()
    sock = tmp_path / "run" / "keeper.sock"
    argv = [sys.executable, "-m", "cachedaemon", "--log-format", "json", "keeper"]
    keeper = LoggedProc([*argv, "--socket", str(sock)])
    counts = Counts()
    try:
        keeper.wait_for("keeper serving")
        path, pid = str(sock), keeper.proc.pid
        memfd = os.memfd_create("good-pool")
        os.ftruncate(memfd, 4096)
        fp = "good-" + "0" * 27
        manifest = Manifest(fp, "memfd", "cpu", "xxh64", (ChunkEntry(4096, 4096),), ())
        assert protocol.call(path, protocol.Deposit(manifest), [memfd])[0] == protocol.Ok()
        os.close(memfd)

        def reclaim() -> None:
            reply, fds = protocol.call(path, protocol.Reclaim(fp), max_fds=wire.MAX_FDS)
            wire.close_fds(fds)
            if reply != protocol.Reclaimed(manifest) or len(fds) != 1:
                raise AssertionError(f"reclaim answered {reply!r} with {len(fds)} fds")
            pools = protocol.call(path, protocol.ListPools())[0]
            if not isinstance(pools, protocol.Pools) or fp not in {
                p.fingerprint for p in pools.pools
            }:
                raise AssertionError(f"list answered {pools!r}")

        reclaim()
        before = fd_count(pid)
        good = GoodClient(reclaim, counts)
        msgs = messages(KEEPER_TYPES, fingerprints)
        fuzz_frame_server(path, msgs, fd_pool, counts, max_fds=wire.MAX_FDS)
        assert good.stop() == []
        assert keeper.proc.poll() is None, keeper.log[-3000:]
        pools = protocol.call(path, protocol.ListPools())[0]
        assert isinstance(pools, protocol.Pools), pools
        for p in pools.pools:  # what the fuzz deposited is escrow, not a leak: withdrawn
            if p.fingerprint != fp:
                assert protocol.call(path, protocol.Withdraw(p.fingerprint))[0] == protocol.Ok()
        after = settled_fds(pid, before)
        assert after <= before, f"the keeper holds {after - before} fds more"
        reclaim()
    finally:
        keeper.stop()
    record(record_property, "keeper", counts, t0)


# ---- the supervisor: agents hub and control socket -----------------------------------------

ENGINES = {"e1", "e2"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Supervisor]:
    tmp = tmp_path_factory.mktemp("fuzz-sup")
    policy = write_policy(
        tmp / "p.yaml",
        tiny_model,
        tmp / "run",
        heartbeat={"interval_ms": 100, "miss_limit": 50},  # a loaded 2-core machine
    )
    sup = Supervisor(policy)
    try:
        sup.wait_pair()
        yield sup
    finally:
        sup.stop()


def engines_of(sup: Supervisor) -> dict[str, tuple[int, int]]:
    st_ = control.request(f"ipc://{sup.run}/control", wire_control.StatusReq()).status
    assert st_ is not None
    return {e.name: (e.pid, e.restarts) for e in st_.engines}


def zmtp_junk(rnd: random.Random) -> bytes:
    """Bytes for a zmq ipc socket: garbage, a cut greeting, or a greeting then a frame
    whose 8-byte length is absurd."""
    greeting = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00")
    greeting += b"\x00" + b"\x00" * 31
    props = b"\x0bSocket-Type" + (6).to_bytes(4, "big") + b"DEALER"
    ready = b"\x05READY" + props
    ready_cmd = b"\x04" + bytes([len(ready)]) + ready
    kind = rnd.randrange(4)
    if kind == 0:
        return rnd.randbytes(rnd.randrange(1, 200))
    if kind == 1:
        return greeting[: rnd.randrange(1, len(greeting))]
    size = rnd.choice((2**62, 2**40, 2**33, 1 << 20))
    long_frame = b"\x02" + size.to_bytes(8, "big") + rnd.randbytes(rnd.randrange(0, 64))
    return greeting + ready_cmd + (long_frame if kind == 2 else rnd.randbytes(64))


def raw_junk(path: str, rnd: random.Random, fd_pool: list[int], counts: Counts, n: int) -> None:
    """`n` raw connections to a zmq ipc socket: junk, fds beside it, abrupt closes."""
    for _ in range(n):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(path)
            counts.connections += 1
            data = zmtp_junk(rnd)
            nfds = rnd.choice((0, 0, 1, 3))
            try:
                if nfds:
                    socket.send_fds(s, [data], fd_pool[:nfds])
                    counts.fds += nfds
                else:
                    s.sendall(data)
            except OSError:
                pass  # libzmq hung up on the junk already
            counts.frames += 1


def test_agents_hub_survives_fuzzing(
    cluster: Supervisor, fd_pool: list[int], record_property: Callable[[str, object], None]
) -> None:
    t0 = time.monotonic()
    sup, pid = cluster, cluster.proc.pid
    endpoint = f"ipc://{sup.run}/agents"
    counts = Counts()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()  # its own: term() flushes it
    engines = engines_of(sup)
    before = fd_count(pid)
    ident = [f"fz-{i}" for i in range(4)]
    names = st.one_of(
        st.sampled_from(ident), st.text(max_size=6).filter(lambda n: n not in ENGINES)
    )
    agent_types = [sp.Hello, sp.Heartbeat, sp.StateChange, sp.Ack, sp.Promote, sp.Drain, sp.Stop]
    msgs = messages(agent_types, names)

    good_sock = ctx.socket(zmq.DEALER)
    good_sock.setsockopt(zmq.IDENTITY, b"good")
    good_sock.setsockopt(zmq.LINGER, 0)
    good_sock.setsockopt(zmq.SNDTIMEO, 5000)
    good_sock.connect(endpoint)
    seq = iter(range(1 << 62))

    def beat() -> None:  # a zmq.Again here is the hub not taking heartbeats
        good_sock.send(sp.encode(sp.Heartbeat("good", next(seq), "ready", 0, 0, 0)))

    socks = []
    for i in ident:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.IDENTITY, i.encode())
        s.setsockopt(zmq.LINGER, 30_000)  # what is queued still reaches the hub
        s.setsockopt(zmq.SNDTIMEO, 10_000)
        s.connect(endpoint)
        socks.append(s)

    @fuzz_settings()
    @given(st.lists(msgs, min_size=4, max_size=12), SEEDS)
    def batch(values: list[Any], seed: int) -> None:
        rnd = random.Random(seed)
        bodies = [encode(v) for v in values]
        for _ in range(PER_EXAMPLE):
            s = rnd.choice(socks)
            shape = rnd.randrange(10)
            if shape == 0:
                s.send_multipart([rnd.choice(bodies), rnd.choice(bodies)])
            elif shape == 1:
                s.send(bad_frame(rnd, rnd.choice(bodies), 1 << 20))
            elif shape == 2:
                s.send(b"")
            else:
                s.send(rnd.choice(bodies))
            counts.frames += 1
        raw_junk(str(sup.run / "agents"), rnd, fd_pool, counts, 2)

    good = GoodClient(beat, counts)
    try:
        batch()
    finally:
        errors = good.stop()
        good_sock.close(linger=0)
        for s in socks:
            s.close()
        ctx.term()  # returns once every frame queued here was handed to the hub's socket
    counts.connections += len(socks)
    assert errors == []
    assert sup.proc.poll() is None, sup.output()
    assert engines_of(sup) == engines, "an engine was restarted while the hub was fuzzed"
    after = settled_fds(pid, before)
    assert after <= before, f"the supervisor holds {after - before} fds more"
    record(record_property, "agents", counts, t0)


def test_control_survives_fuzzing(
    cluster: Supervisor, fd_pool: list[int], record_property: Callable[[str, object], None]
) -> None:
    t0 = time.monotonic()
    sup, pid = cluster, cluster.proc.pid
    endpoint = f"ipc://{sup.run}/control"
    counts = Counts()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    engines = engines_of(sup)
    before = fd_count(pid)
    names = st.text(max_size=6).filter(lambda n: n not in ENGINES)
    req_types = [
        wire_control.StatusReq,
        wire_control.PromoteReq,
        wire_control.EvictReq,
        wire_control.RestartReq,
    ]
    msgs = messages([*req_types, wire_control.StopReq, wire_control.ControlReply], names)
    decoder = msgspec.msgpack.Decoder(wire_control.Request)

    def harmless(body: bytes) -> bytes:  # a real stop is not a crash: it stays unsent
        try:
            req = decoder.decode(body)
        except msgspec.MsgspecError:
            return body
        return (
            encode({"type": "StopReq", "x": 1}) if isinstance(req, wire_control.StopReq) else body
        )

    def status() -> None:
        reply = control.request(endpoint, wire_control.StatusReq(), timeout=20)
        if not reply.ok or reply.status is None or len(reply.status.engines) != len(engines):
            raise AssertionError(f"status answered {reply!r}")

    socks = []
    for _ in range(4):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDTIMEO, 10_000)
        s.connect(endpoint)
        socks.append(s)
    poller = zmq.Poller()
    for s in socks:
        poller.register(s, zmq.POLLIN)

    @fuzz_settings()
    @given(st.lists(msgs, min_size=4, max_size=12), SEEDS)
    def batch(values: list[Any], seed: int) -> None:
        rnd = random.Random(seed)
        bodies = [harmless(encode(v)) for v in values]
        expected = 0
        for _ in range(PER_EXAMPLE):
            s = rnd.choice(socks)
            shape = rnd.randrange(10)
            body = rnd.choice(bodies)
            if shape == 0:
                s.send_multipart([body])  # no empty delimiter: dropped and counted
            elif shape == 1:
                s.send_multipart([b"", body, body])
            elif shape == 2:
                s.send_multipart([b"x", body])
            else:
                s.send_multipart([b"", bad_frame(rnd, body, 1 << 20) if shape == 3 else body])
                expected += 1
            counts.frames += 1
        deadline = time.monotonic() + 60
        while expected > 0:  # every well-framed request is answered
            assert time.monotonic() < deadline, f"{expected} control requests unanswered"
            for s, _ in poller.poll(1000):
                assert isinstance(s, zmq.Socket)
                frames = s.recv_multipart()
                assert frames[0] == b"" and wire_control.decode_reply(frames[1]) is not None
                counts.replies += 1
                expected -= 1
        raw_junk(str(sup.run / "control"), rnd, fd_pool, counts, 2)

    good = GoodClient(status, counts)
    try:
        batch()
    finally:
        errors = good.stop()
        for s in socks:
            s.close(linger=0)
    counts.connections += len(socks)
    assert errors == []
    assert sup.proc.poll() is None, sup.output()
    assert engines_of(sup) == engines, "an engine was restarted while control was fuzzed"
    after = settled_fds(pid, before)
    assert after <= before, f"the supervisor holds {after - before} fds more"
    record(record_property, "control", counts, t0)


def test_a_hello_no_process_can_have_leaves_the_hub_serving(cluster: Supervisor) -> None:
    """A Hello under an engine's own name whose pid no process can have (past the kernel's
    pid range) is dropped; it used to end the hub's task, and with it the supervisor.
    Runs after the fuzz tests of this cluster: it takes e1's identity over."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.IDENTITY, b"e1")
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"ipc://{cluster.run}/agents")
    try:
        for pid in (2**40, 2**63 - 1, -(2**63)):
            s.send(sp.encode(sp.Hello("e1", "standby", pid, 1, 0)))
        mark = cluster.tap.mark()
        s.send(sp.encode(sp.Hello("e1", "standby", os.getpid(), 1, 0)))  # a pid of another group
        ev = cluster.wait(lambda e: e.topic == "engine.e1.stray-hello", timeout=30, after=mark)
        assert ev.data["pid"] == os.getpid()  # the hub read on past the absurd ones
    finally:
        s.close(linger=0)
    assert cluster.proc.poll() is None, cluster.output()
    assert set(engines_of(cluster)) >= ENGINES


# ---- the fork server ----------------------------------------------------------------------

MAX_FORKS = 40  # valid requests with 3 fds fork (into a cwd that does not exist): a few


def test_forkserver_survives_fuzzing(
    forkserver: Any,
    tmp_path: Path,
    fd_pool: list[int],
    record_property: Callable[[str, object], None],
) -> None:
    t0 = time.monotonic()
    path, pid = str(forkserver.sock), forkserver.proc.pid
    counts = Counts()
    forks = [0]
    null = os.open(os.devnull, os.O_RDWR)
    spawn = fs.Spawn(argv=["--help"], env=child_env(), cwd=str(tmp_path))

    def help_engine() -> None:
        sock, child = fs.request(path, spawn, [null, null, null])  # the supervisor's timeout
        with sock:
            sock.settimeout(60)
            reply = fs.read_reply(sock)
        if reply != fs.Exited(0):
            raise AssertionError(f"engine {child} --help ended with {reply!r}")

    help_engine()
    before = fd_count(pid)
    names = st.one_of(st.just("/nonexistent/holdfast-fuzz"), st.text(max_size=6))
    msgs = messages([fs.Spawn, fs.Started, fs.Exited, fs.Refused], names)
    decodes = decodes_as(fs.decode_spawn)
    fuzzer = StreamFuzzer(path, fd_pool, counts)
    stalled = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(3)]

    def tame(value: Any) -> bytes:  # a Spawn that forks runs nothing: its cwd does not exist
        body = encode(value)
        if decodes(body):
            req = fs.decode_spawn(body)
            body = encode(msgspec.structs.replace(req, cwd="/nonexistent/holdfast-fuzz", env={}))
        return body

    @fuzz_settings()
    @given(st.lists(msgs, min_size=4, max_size=12), SEEDS)
    def batch(values: list[Any], seed: int) -> None:
        rnd = random.Random(seed)
        bodies = [tame(v) for v in values]
        plans = []
        for _ in range(PER_EXAMPLE):  # the server reads one frame per connection
            body = rnd.choice(bodies)
            frame = HEADER.pack(len(body)) + body
            if rnd.random() < 0.3:
                frame = bad_frame(rnd, body, fs.MAX_FRAME)
            nfds = rnd.choice((0, 1, 2, 3, 3, 4))
            if nfds == 3 and decodes(body):
                if forks[0] >= MAX_FORKS:
                    nfds = 2
                forks[0] += nfds == 3
            abrupt = rnd.random() < 0.2
            plan = Plan(
                split(frame, rnd, nfds, rnd.random() < 0.1), abrupt, abrupt and rnd.random() < 0.5
            )
            plans.append(plan)
        counts.frames += len(plans)
        fuzzer.run(plans, at_once=8)

    good = GoodClient(help_engine, counts)
    try:
        for s in stalled:  # half a header, then silence for the whole run
            s.connect(path)
            s.sendall(b"\x00\x00")
        batch()
    finally:
        errors = good.stop()
        for s in stalled:
            s.close()
        os.close(null)
    assert errors == []
    assert forkserver.proc.poll() is None, forkserver.log[-3000:]
    after = settled_fds(pid, before)
    assert after <= before, f"the fork server holds {after - before} fds more"
    help_engine()
    record(record_property, "forkserver", counts, t0)


# ---- what fuzzing found, each pinned down -------------------------------------------------


def test_forkserver_answers_while_other_peers_stall(forkserver: Any, tmp_path: Path) -> None:
    """Peers that send half a request and go silent hold up nobody: a request behind four
    of them is answered within the supervisor's timeout (each used to hold the server 5 s)."""
    stalled = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(4)]
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for s in stalled:
            s.connect(str(forkserver.sock))
            s.sendall(b"\x00\x00")
        spawn = fs.Spawn(argv=["--help"], env=child_env(), cwd=str(tmp_path))
        sock, _ = fs.request(forkserver.sock, spawn, [null, null, null])
        with sock:
            sock.settimeout(60)
            assert fs.read_reply(sock) == fs.Exited(0)
        for s in stalled:  # and each silent peer is told why it was dropped
            s.settimeout(60)
            assert fs.read_reply(s) == fs.Refused("timed out waiting for a frame")
    finally:
        os.close(null)
        for s in stalled:
            s.close()


def test_forkserver_closes_the_fds_of_a_frame_with_too_many(forkserver: Any) -> None:
    """A request with more than 3 fds is refused and the 3 that were received are closed."""
    pid = forkserver.proc.pid
    before = fd_count(pid)
    null = os.open(os.devnull, os.O_RDWR)
    body = encode({"type": "Spawn", "argv": [], "env": {}, "cwd": "/"})
    try:
        for _ in range(50):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(60)
                s.connect(str(forkserver.sock))
                socket.send_fds(s, [HEADER.pack(len(body)) + body], [null] * 4)
                assert fs.read_reply(s) == fs.Refused("more than 3 fds sent with one frame")
    finally:
        os.close(null)
    assert settled_fds(pid, before) <= before, f"{fd_count(pid) - before} fds kept"


def test_a_deposit_too_big_to_list_is_refused(tmp_path: Path) -> None:
    """A manifest whose chunk sizes add up past what a reply can carry is refused, so it
    cannot break ListPools for every other client."""
    from cachedaemon.keeper import Keeper

    with Keeper(tmp_path / "run" / "keeper.sock") as keeper:
        path = str(keeper.socket_path)
        huge = Manifest("huge", "memfd", "cpu", "xxh64", (ChunkEntry(2**64 - 1, 0),) * 2, ())
        negative = Manifest("neg", "memfd", "cpu", "xxh64", (ChunkEntry(-1, 0),), ())
        for manifest in (huge, negative):
            fds = [os.open(os.devnull, os.O_RDONLY) for _ in manifest.chunks]
            try:
                reply = protocol.call(path, protocol.Deposit(manifest), fds)[0]
            finally:
                wire.close_fds(fds)
            assert isinstance(reply, protocol.ErrorReply) and "chunk sizes" in reply.message
        assert protocol.call(path, protocol.ListPools())[0] == protocol.Pools([])


def test_reclaims_racing_new_deposits_get_the_pool_s_own_fds(tmp_path: Path) -> None:
    """Each reclaim, while the same pool is deposited anew over and over, gets fds of one of
    the deposited pools: the escrow's fds used to be closed by the new deposit before the
    reply went out (a dropped connection, or whatever file had taken the fd number)."""
    from cachedaemon.keeper import Keeper

    manifest = Manifest("raced", "memfd", "cpu", "xxh64", (ChunkEntry(4096, 4096),), ())
    inodes: set[int] = set()
    stop = threading.Event()

    def redeposit() -> None:
        while not stop.is_set():
            fd = os.memfd_create("pool")
            inodes.add(os.fstat(fd).st_ino)
            try:
                protocol.call(path, protocol.Deposit(manifest), [fd])
            finally:
                os.close(fd)

    with Keeper(tmp_path / "run" / "keeper.sock") as keeper:
        path = str(keeper.socket_path)
        redeposit_once = os.memfd_create("pool")
        inodes.add(os.fstat(redeposit_once).st_ino)
        protocol.call(path, protocol.Deposit(manifest), [redeposit_once])
        os.close(redeposit_once)
        depositor = threading.Thread(target=redeposit)
        depositor.start()
        try:
            for _ in range(2000):
                reply, fds = protocol.call(path, protocol.Reclaim("raced"), max_fds=8)
                try:
                    assert reply == protocol.Reclaimed(manifest) and len(fds) == 1
                    assert os.fstat(fds[0]).st_ino in inodes, os.readlink(f"/proc/self/fd/{fds[0]}")
                finally:
                    wire.close_fds(fds)
        finally:
            stop.set()
            depositor.join()
