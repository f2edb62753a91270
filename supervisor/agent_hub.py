"""The supervisor's end of the agent protocol: a ROUTER at `ipc://<run>/agents`.

Engines connect with a DEALER whose identity is their name. A restarted engine reuses its
name, so the ROUTER hands the identity over to the newest connection. Garbage frames are
dropped and counted; each decoded message goes to the one handler for its type (the `AgentReports` given to `serve`). A message
its handler cannot take (a pid past the kernel's range, say) is dropped, counted and logged:
no peer's message ends the hub.

The socket is a plain one, read from the event loop's reader on its ZMQ_FD, so that a
command (`send`, a promotion's `Promote` above all) is two non-blocking sends and nothing
else: pyzmq's asyncio socket adds a future, a copy of the arguments and a ZMQ_EVENTS query
to each, which cold (once in a failover) cost about 50 µs of a promotion's 200.
ZMQ_FD is edge-triggered: any call on the socket may take the notice of a frame that
arrived meanwhile, so the reader drains until EAGAIN, and each send asks for a drain.
"""

from __future__ import annotations

import asyncio
import contextlib

import msgspec
import structlog
import zmq

from holdfast_contract import agent_protocol as wire
from holdfast_contract.agent_protocol import Ack, Heartbeat, Hello, Refitted, StateChange
from supervisor.wiring import AgentReports

log = structlog.get_logger("supervisor.agent_hub")

DRAIN_BUDGET = 256  # frames taken in one go before the rest of the loop gets a turn


class AgentHub:
    def __init__(self, endpoint: str) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.bind(endpoint)
        self.malformed = 0
        self._readable = asyncio.Event()  # the socket may hold frames: drain it

    async def serve(self, into: AgentReports) -> None:
        """Deliver what the agents send to `into`, until cancelled."""
        loop = asyncio.get_running_loop()
        fd = self._sock.fileno()  # ZMQ_FD
        loop.add_reader(fd, self._readable.set)
        try:
            while True:
                self._readable.clear()
                if self._drain(into):
                    await asyncio.sleep(0)  # more may wait: let the rest of the loop run first
                    self._readable.set()
                await self._readable.wait()
        finally:
            loop.remove_reader(fd)

    def drain(self, into: AgentReports) -> None:
        """Deliver to `into` what waits on the socket now, before a silence is judged."""
        self._drain(into)

    def _drain(self, into: AgentReports, budget: int = DRAIN_BUDGET) -> bool:
        """Take up to `budget` frames off the socket; True if it stopped at the budget."""
        for _ in range(budget):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return False
            self._take(frames, into)
        return True

    def _take(self, frames: list[bytes], into: AgentReports) -> None:
        if len(frames) != 2:
            self.malformed += 1
            return
        ident, body = frames
        try:
            msg = wire.decode_agent(body)
        except msgspec.DecodeError:
            self.malformed += 1
            return
        if getattr(msg, "name", None) != ident.decode(errors="replace"):
            self.malformed += 1  # a name that is not the sender's identity
            return
        try:
            _dispatch(msg, into)
        except (ValueError, OverflowError, OSError) as e:
            self.malformed += 1
            log.warning("agent message dropped", agent=ident.decode(errors="replace"), error=str(e))

    def send(self, name: str, cmd: wire.Promote | wire.Drain | wire.Stop | wire.Refit) -> bool:
        """Queue a command for `name`; False when that agent is not connected (or its queue
        is full)."""
        try:
            self._sock.send(name.encode(), zmq.SNDMORE | zmq.NOBLOCK)
            self._sock.send(wire.encode(cmd), zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        finally:
            self._readable.set()  # the sends may have taken an arrival's notice
        return True

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._sock.close(linger=0)


def _dispatch(msg: Hello | Heartbeat | StateChange | Ack | Refitted, into: AgentReports) -> None:
    if isinstance(msg, Heartbeat):
        into.on_heartbeat(msg)
    elif isinstance(msg, Hello):
        into.on_hello(msg)
    elif isinstance(msg, StateChange):
        into.on_state(msg)
    elif isinstance(msg, Refitted):
        into.on_refitted(msg)
    else:
        into.on_ack(msg)
