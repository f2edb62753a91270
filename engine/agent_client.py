"""The engine's end of the agent protocol: the SDK every engine uses to talk to the
supervisor (pyzmq + msgspec, no torch; `supervisor.agent_hub` is the other end).

An engine creates one AgentClient, registers callbacks for the supervisor's commands and
starts it. The client owns one DEALER socket (identity = the engine's name) and one thread
that sends Hello, a Heartbeat every interval with the engine's load, queued StateChanges,
and runs the callbacks for Promote / Drain / Stop / Refit, acknowledging each with an Ack (the
messages are `holdfast_contract.agent_protocol`).

    agent = AgentClient.from_env(load=lambda: (server.in_flight, server.queued))
    if agent is not None:
        agent.on_promote(lambda epoch: server.become_primary(epoch))
        agent.start()
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from engine.errors import AgentError
from holdfast_contract import agent_protocol as wire
from holdfast_contract.env import DEFAULT_HEARTBEAT_MS, read_env, var
from holdfast_contract.errors import EnvError

LoadFn = Callable[[], tuple[int, int]]
PromoteCb = Callable[[int], None]
DrainCb = Callable[[float], None]
StopCb = Callable[[], None]
RefitCb = Callable[[wire.Refit], None]
# what a promoted engine did with a dead engine's KV cache: the streams it took over, or
# None and why not (None and "": it was not asked, or keeps its cache private)
Adopted = tuple[int | None, str]


def _no_load() -> tuple[int, int]:
    return (0, 0)


class AgentClient:
    """Heartbeats and commands between one engine process and the supervisor."""

    def __init__(
        self,
        endpoint: str,
        *,
        name: str,
        role: str,
        port: int,
        epoch: int = 0,
        interval_s: float = 0.05,
        load: LoadFn | None = None,
    ) -> None:
        if interval_s <= 0:
            raise AgentError(f"interval_s={interval_s} must be > 0 (HOLDFAST_HEARTBEAT_MS)")
        self.endpoint, self.interval_s = endpoint, interval_s
        self.name, self.role, self.port, self.epoch = name, role, port, epoch
        self._load = load or _no_load
        self._state = "starting"
        self._on_promote: list[PromoteCb] = []
        self._on_adopt: list[Callable[[str, str], Adopted]] = []
        self._on_drain: list[DrainCb] = []
        self._on_stop: list[StopCb] = []
        self._on_refit: list[RefitCb] = []
        self._outbox: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._seq = 0

    @classmethod
    def from_env(cls, load: LoadFn | None = None) -> AgentClient | None:
        """An agent configured by the supervisor's environment, or None when unsupervised."""
        try:
            env = read_env()
        except EnvError as e:
            raise AgentError(str(e)) from e
        if not env.agent:
            return None
        name, port = env.name, env.port
        if name is None:
            raise AgentError(f"{var('name')} is not set; the supervisor sets it for every engine")
        if port is None:
            raise AgentError(f"{var('port')} is not set; the supervisor sets it for every engine")
        return cls(
            env.agent,
            name=name,
            role=env.role or "standby",
            port=port,
            epoch=env.epoch or 0,
            interval_s=(env.heartbeat_ms or DEFAULT_HEARTBEAT_MS) / 1000.0,
            load=load,
        )

    # ---- callbacks ----
    def on_adopt(self, cb: Callable[[str, str], Adopted]) -> None:
        """`cb(kv, kv_ident)` runs on this thread before a Promote's other callbacks and its ack:
        the router sends the promoted engine nothing before the ack. What it says of a
        dead engine's KV cache (`Adopted`) goes back in the ack."""
        self._on_adopt.append(cb)

    def on_promote(self, cb: PromoteCb) -> None:
        self._on_promote.append(cb)

    def on_drain(self, cb: DrainCb) -> None:
        self._on_drain.append(cb)

    def on_stop(self, cb: StopCb) -> None:
        self._on_stop.append(cb)

    def on_refit(self, cb: RefitCb) -> None:
        """`cb` starts a refit (and returns at once); its end goes out as `refitted`."""
        self._on_refit.append(cb)

    def refitted(self, msg: wire.Refitted) -> None:
        """Report the end of a refit to the supervisor."""
        self._send(wire.encode(msg))

    # ---- lifecycle ----
    def start(self) -> None:
        """Send Hello and start the heartbeat/command thread. Call once."""
        if self._thread is not None:
            raise AgentError("AgentClient.start() was already called; call it once per agent")
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._thread = threading.Thread(target=self._run, name=f"agent-{self.name}", daemon=True)
        self._thread.start()

    def set_state(self, state: str, detail: str = "") -> None:
        """Report a state change now (also carried by every following heartbeat)."""
        self._state = state
        self._send(wire.encode(wire.StateChange(name=self.name, state=state, detail=detail)))

    def close(self) -> None:
        """Stop the thread and close the socket; safe to call twice."""
        self._closing.set()
        self._wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        for s in (self._wake_r, self._wake_w):
            if s is not None:
                s.close()

    def __enter__(self) -> AgentClient:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- thread ----
    def _send(self, frame: bytes) -> None:
        self._outbox.put(frame)
        self._wake()

    def _wake(self) -> None:
        # Not started, already closed, or the wake buffer is full: the thread wakes anyway.
        if self._wake_w is not None:
            with contextlib.suppress(OSError):
                self._wake_w.send(b"\0")

    def _run(self) -> None:
        wake = self._wake_r
        if wake is None:
            return
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.name.encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 1000)
        sock.connect(self.endpoint)
        try:
            sock.send(wire.encode(self._hello()))
            self._loop(sock, wake)
        finally:
            sock.close(linger=0)

    def _hello(self) -> wire.Hello:
        return wire.Hello(
            name=self.name,
            role=self.role,
            pid=os.getpid(),
            port=self.port,
            epoch=self.epoch,
            tid=threading.get_native_id(),  # _hello runs on the heartbeat thread
        )

    def _loop(self, sock: zmq.Socket[bytes], wake: socket.socket) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(wake.fileno(), zmq.POLLIN)
        next_beat = time.monotonic()
        while not self._closing.is_set():
            now = time.monotonic()
            if now >= next_beat:
                self._send_nowait(sock, wire.encode(self._heartbeat()))
                next_beat = now + self.interval_s
            events = dict(
                poller.poll(timeout=int(max(0.0, next_beat - time.monotonic()) * 1000) + 1)
            )
            if wake.fileno() in events:
                self._drain_wake(wake)
            while not self._outbox.empty():
                self._send_nowait(sock, self._outbox.get_nowait())
            if sock in events:
                self._recv_commands(sock)

    @staticmethod
    def _drain_wake(wake: socket.socket) -> None:
        try:
            while wake.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _send_nowait(self, sock: zmq.Socket[bytes], frame: bytes) -> None:
        with contextlib.suppress(zmq.Again):  # supervisor gone or slow: best effort by design
            sock.send(frame, zmq.NOBLOCK)

    def _heartbeat(self) -> wire.Heartbeat:
        self._seq += 1
        try:
            in_flight, queued = self._load()
        except Exception:  # a load callback must never stop the heartbeat
            in_flight, queued = (0, 0)
        return wire.Heartbeat(
            name=self.name,
            seq=self._seq,
            state=self._state,
            in_flight=int(in_flight),
            queued=int(queued),
            epoch=self.epoch,
        )

    def _recv_commands(self, sock: zmq.Socket[bytes]) -> None:
        while True:
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                cmd = wire.decode_command(frame)
            except msgspec.DecodeError:
                continue  # garbage from the wire is dropped, never fatal
            self._send_nowait(sock, wire.encode(self._dispatch(cmd)))

    def _dispatch(self, cmd: wire.Promote | wire.Drain | wire.Stop | wire.Refit) -> wire.Ack:
        name = type(cmd).__name__.lower()
        kv: Adopted = (None, "")
        try:
            if isinstance(cmd, wire.Promote):
                for a in self._on_adopt:
                    kv = a(cmd.kv, cmd.kv_ident)
                self.epoch = cmd.epoch
                self.role = "primary"
                for p in self._on_promote:
                    p(cmd.epoch)
            elif isinstance(cmd, wire.Drain):
                for d in self._on_drain:
                    d(cmd.grace_s)
            elif isinstance(cmd, wire.Refit):
                if not self._on_refit:
                    raise AgentError("this engine does not refit its weights in place")
                for r in self._on_refit:
                    r(cmd)
            else:
                for s in self._on_stop:
                    s()
        except Exception as e:  # the engine's callback failed: tell the supervisor
            return wire.Ack(
                name=self.name, command=name, ok=False, detail=f"{type(e).__name__}: {e}"
            )
        return wire.Ack(name=self.name, command=name, ok=True, kv_streams=kv[0], kv_why=kv[1])
