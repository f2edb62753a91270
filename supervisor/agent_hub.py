"""The supervisor's end of the agent protocol: a ROUTER at `ipc://<run>/agents`.

Engines connect with a DEALER whose identity is their name. A restarted engine reuses its
name, so the ROUTER hands the identity over to the newest connection. Garbage frames are
dropped and counted; each decoded message goes to the one handler for its type. A message
its handler cannot take (a pid past the kernel's range, say) is dropped, counted and logged:
no peer's message ends the hub.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import msgspec
import structlog
import zmq
import zmq.asyncio

from holdfast_contract import agent_protocol as wire
from holdfast_contract.agent_protocol import Ack, Heartbeat, Hello, StateChange

log = structlog.get_logger("supervisor.agent_hub")


class AgentHub:
    def __init__(
        self,
        endpoint: str,
        *,
        on_hello: Callable[[Hello], None],
        on_heartbeat: Callable[[Heartbeat], None],
        on_state: Callable[[StateChange], None],
        on_ack: Callable[[Ack], None],
    ) -> None:
        self._sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.bind(endpoint)
        self._on_hello = on_hello
        self._on_heartbeat = on_heartbeat
        self._on_state = on_state
        self._on_ack = on_ack
        self.malformed = 0

    async def serve(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            if len(frames) != 2:
                self.malformed += 1
                continue
            ident, body = frames
            try:
                msg = wire.decode_agent(body)
            except msgspec.DecodeError:
                self.malformed += 1
                continue
            if getattr(msg, "name", None) != ident.decode(errors="replace"):
                self.malformed += 1  # a name that is not the sender's identity
                continue
            try:
                self._dispatch(msg)
            except (ValueError, OverflowError, OSError) as e:
                self.malformed += 1
                log.warning(
                    "agent message dropped", agent=ident.decode(errors="replace"), error=str(e)
                )

    def _dispatch(self, msg: Hello | Heartbeat | StateChange | Ack) -> None:
        if isinstance(msg, Heartbeat):
            self._on_heartbeat(msg)
        elif isinstance(msg, Hello):
            self._on_hello(msg)
        elif isinstance(msg, StateChange):
            self._on_state(msg)
        else:
            self._on_ack(msg)

    def send(self, name: str, cmd: wire.Promote | wire.Drain | wire.Stop) -> bool:
        """Queue a command for `name`; False when that agent is not connected."""
        try:
            sent = self._sock.send_multipart([name.encode(), wire.encode(cmd)], zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        # The asyncio socket reports a refused send on the (already finished) future.
        return not (
            isinstance(sent, asyncio.Future) and sent.done() and sent.exception() is not None
        )

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._sock.close(linger=0)
