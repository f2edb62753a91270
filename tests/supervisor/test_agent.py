"""The agent SDK against a real zmq ROUTER socket, as the supervisor uses it."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from engine.agent_client import AgentClient
from engine.errors import AgentError
from holdfast_contract.agent_protocol import (
    Ack,
    Drain,
    Heartbeat,
    Hello,
    Promote,
    StateChange,
    Stop,
    decode_agent,
    encode,
)


@pytest.fixture
def router(tmp_path: Path) -> Iterator[tuple[zmq.Socket[bytes], str]]:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{tmp_path}/agents"
    sock.bind(endpoint)
    yield sock, endpoint
    sock.close(linger=0)


def recv_until(
    sock: zmq.Socket[bytes], kind: type, deadline_s: float = 5.0
) -> tuple[bytes, object]:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if sock.poll(timeout=100):
            ident, frame = sock.recv_multipart()
            msg = decode_agent(frame)
            if isinstance(msg, kind):
                return ident, msg
    raise AssertionError(f"no {kind.__name__} within {deadline_s}s")


def test_hello_heartbeat_state_and_commands(router: tuple[zmq.Socket[bytes], str]) -> None:
    sock, endpoint = router
    promoted: queue.SimpleQueue[int] = queue.SimpleQueue()
    drained: queue.SimpleQueue[float] = queue.SimpleQueue()
    stopped: queue.SimpleQueue[bool] = queue.SimpleQueue()
    agent = AgentClient(
        endpoint,
        name="e1",
        role="standby",
        port=9001,
        epoch=3,
        interval_s=0.02,
        load=lambda: (7, 2),
    )
    agent.on_promote(promoted.put)
    agent.on_drain(drained.put)
    agent.on_stop(lambda: stopped.put(True))
    agent.start()
    try:
        ident, hello = recv_until(sock, Hello)
        assert ident == b"e1"
        assert isinstance(hello, Hello)
        assert hello == Hello(
            name="e1", role="standby", pid=os.getpid(), port=9001, epoch=3, tid=hello.tid
        )
        assert agent._thread is not None  # the heartbeat thread names itself:
        assert hello.tid == agent._thread.native_id
        _, beat = recv_until(sock, Heartbeat)
        assert isinstance(beat, Heartbeat)
        assert (beat.in_flight, beat.queued, beat.state) == (7, 2, "starting")

        agent.set_state("ready", detail="warm")
        _, change = recv_until(sock, StateChange)
        assert change == StateChange(name="e1", state="ready", detail="warm")
        _, beat = recv_until(sock, Heartbeat)
        assert isinstance(beat, Heartbeat) and beat.state == "ready"

        sock.send_multipart([b"e1", b"\xc1garbage"])  # dropped, not fatal
        sock.send_multipart([b"e1", encode(Promote(epoch=4))])
        _, ack = recv_until(sock, Ack)
        assert ack == Ack(name="e1", command="promote", ok=True)
        assert promoted.get(timeout=5) == 4
        _, beat = recv_until(sock, Heartbeat)
        assert isinstance(beat, Heartbeat) and beat.epoch == 4

        sock.send_multipart([b"e1", encode(Drain(grace_s=1.5))])
        recv_until(sock, Ack)
        assert drained.get(timeout=5) == 1.5
        sock.send_multipart([b"e1", encode(Stop())])
        recv_until(sock, Ack)
        assert stopped.get(timeout=5) is True
    finally:
        agent.close()


def test_failing_callback_is_acked_not_ok(router: tuple[zmq.Socket[bytes], str]) -> None:
    sock, endpoint = router

    def boom(epoch: int) -> None:
        raise RuntimeError(f"cannot take epoch {epoch}")

    with AgentClient(endpoint, name="e2", role="standby", port=1, load=None) as agent:
        agent.on_promote(boom)
        recv_until(sock, Hello)
        sock.send_multipart([b"e2", encode(Promote(epoch=9))])
        _, ack = recv_until(sock, Ack)
        assert isinstance(ack, Ack) and not ack.ok
        assert "cannot take epoch 9" in ack.detail
        _, beat = recv_until(sock, Heartbeat)  # the thread survived
        assert isinstance(beat, Heartbeat)


def test_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HOLDFAST_AGENT", raising=False)
    assert AgentClient.from_env() is None
    monkeypatch.setenv("HOLDFAST_AGENT", "ipc:///nonexistent/agents")
    monkeypatch.setenv("HOLDFAST_NAME", "b1")
    monkeypatch.setenv("HOLDFAST_ROLE", "batch")
    monkeypatch.setenv("HOLDFAST_PORT", "8123")
    monkeypatch.setenv("HOLDFAST_EPOCH", "2")
    monkeypatch.setenv("HOLDFAST_HEARTBEAT_MS", "20")
    agent = AgentClient.from_env()
    assert agent is not None
    assert (agent.name, agent.role, agent.port, agent.epoch, agent.interval_s) == (
        "b1",
        "batch",
        8123,
        2,
        0.02,
    )
    monkeypatch.setenv("HOLDFAST_PORT", "eighty")
    with pytest.raises(AgentError, match="HOLDFAST_PORT"):
        AgentClient.from_env()


def test_agent_client_and_cli_import_without_torch() -> None:
    code = (
        "import engine.agent_client, holdfast_contract.agent_protocol, supervisor.cli; "
        "import sys; assert 'torch' not in sys.modules, 'torch imported'"
    )
    repo = Path(__file__).resolve().parents[2]
    subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        env={**os.environ, "PYTHONPATH": str(repo)},
    )
