"""An engine under a real zmq ROUTER (as the supervisor runs it): standby, promote,
heartbeats during a long forward pass, and SIGTERM with a request in flight."""

from __future__ import annotations

import os
import queue
import threading
import time
import urllib.error
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from engine.launch import EngineProcess
from holdfast_contract.agent_protocol import (
    Ack,
    Heartbeat,
    Hello,
    Promote,
    StateChange,
    decode_agent,
    encode,
)
from tests.engine.test_engine_serve import post

LONG = {"prompt_token_ids": [5] * 8, "max_tokens": 500, "ignore_eos": True}
BEAT_MS = 20
BUSY = 5  # heartbeats that must report a long request in flight
MAX_LONG = 100  # long requests sent, at most, until they have


class Router:
    """The supervisor's side: a ROUTER on its own thread, every message timestamped."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.got: list[tuple[float, Any]] = []
        self._out: queue.SimpleQueue[tuple[bytes, bytes]] = queue.SimpleQueue()
        self._arrived = threading.Condition()
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._bound.wait(5)

    def _run(self) -> None:
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.endpoint)
        self._bound.set()
        try:
            while not self._stop.is_set():
                while not self._out.empty():
                    sock.send_multipart(list(self._out.get()))
                if sock.poll(timeout=10):
                    _, frame = sock.recv_multipart()
                    with self._arrived:
                        self.got.append((time.monotonic(), decode_agent(frame)))
                        self._arrived.notify_all()
        finally:
            sock.close(linger=0)

    def send(self, name: str, msg: Promote) -> None:
        self._out.put((name.encode(), encode(msg)))

    def wait_for(self, pred: Any, timeout: float = 30.0, since: int = 0) -> Any:
        """The first message from index `since` on matching pred, waiting up to timeout."""
        end = time.monotonic() + timeout
        with self._arrived:
            while True:
                hit = next((m for _, m in self.got[since:] if pred(m)), None)
                if hit is not None or time.monotonic() >= end:
                    break
                self._arrived.wait(end - time.monotonic())
        if hit is None:
            raise AssertionError(f"no matching agent message within {timeout} s")
        return hit

    def count(self, pred: Any, since: int = 0) -> int:
        """How many messages from index `since` on match pred."""
        with self._arrived:
            return sum(1 for _, m in self.got[since:] if pred(m))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.fixture
def supervised(tiny_model: Path, tmp_path: Path) -> Iterator[tuple[EngineProcess, Router]]:
    router = Router(f"ipc://{tmp_path}/agents")
    env = dict(
        os.environ,
        HOLDFAST_AGENT=router.endpoint,
        HOLDFAST_NAME="sb",
        HOLDFAST_ROLE="standby",
        HOLDFAST_EPOCH="3",
        HOLDFAST_MODEL=str(tiny_model),
        HOLDFAST_HEARTBEAT_MS=str(BEAT_MS),
        HOLDFAST_DTYPE="float32",
    )
    # one torch thread and a long grace: on cores other processes keep busy, a multi-threaded
    # op waits at its barrier for a descheduled thread, and the request in flight at the
    # SIGTERM below could outlast the default 30 s grace (the engine then leaves without it)
    engine = EngineProcess(["--allow-disk-fallback", "--threads", "1", "--grace-s", "300"], env=env)
    try:
        engine.wait_ready()
        yield engine, router
    finally:
        engine.stop()
        router.close()


def test_standby_promote_heartbeats_and_sigterm(supervised: tuple[EngineProcess, Router]) -> None:
    engine, router = supervised
    hello = router.wait_for(lambda m: isinstance(m, Hello))
    assert (hello.name, hello.role, hello.epoch, hello.port) == ("sb", "standby", 3, engine.port)
    router.wait_for(lambda m: isinstance(m, StateChange) and m.state == "ready")

    status, headers, body = post(engine.url, {"prompt_token_ids": [1], "max_tokens": 2})
    assert status == 503 and "standby" in body["error"]["message"]
    assert headers["X-Holdfast-Role"] == "standby"

    router.send("sb", Promote(epoch=4))
    assert router.wait_for(lambda m: isinstance(m, Ack)).ok
    router.wait_for(lambda m: isinstance(m, StateChange) and m.state == "serving")
    status, headers, _ = post(engine.url, {"prompt_token_ids": [1], "max_tokens": 2})
    assert status == 200 and headers["X-Holdfast-Epoch"] == "4"

    # Heartbeats keep coming while the model computes: long requests, one after another,
    # until enough heartbeats have reported one in flight (counted, not timed).
    seen, sent = len(router.got), 0
    while router.count(lambda m: isinstance(m, Heartbeat) and m.in_flight == 1, seen) < BUSY:
        assert sent < MAX_LONG, f"{sent} long requests, fewer than {BUSY} busy heartbeats"
        status, _, body = post(engine.url, LONG)
        assert status == 200 and len(body["choices"][0]["token_ids"]) == 500
        sent += 1
    print(f"{sent} long requests, {BUSY}+ heartbeats reported them in flight")

    # SIGTERM with a request in flight: it finishes, new ones are refused, exit 0.
    result: list[tuple[int, Any]] = []
    worker = threading.Thread(target=lambda: result.append(post(engine.url, LONG)[::2]))
    seen = len(router.got)
    worker.start()
    router.wait_for(lambda m: isinstance(m, Heartbeat) and m.in_flight == 1, since=seen)
    engine.proc.terminate()
    router.wait_for(lambda m: isinstance(m, StateChange) and m.state == "draining")
    try:
        status, _, refused = post(engine.url, {"prompt_token_ids": [1], "max_tokens": 1})
        assert status == 503 and "draining" in refused["error"]["message"]
    except (urllib.error.URLError, ConnectionResetError) as e:
        # On a loaded machine the request in flight may have ended (and the engine closed
        # its socket) before this one was sent, or while it waited to be accepted: then
        # there is no drain left to refuse in, and what is checked is that the one in
        # flight still completed, below.
        reason = e.reason if isinstance(e, urllib.error.URLError) else e
        assert isinstance(reason, (ConnectionRefusedError, ConnectionResetError)), e
    worker.join(60)
    assert result and result[0][0] == 200
    assert len(result[0][1]["choices"][0]["token_ids"]) == 500
    assert engine.wait_exit(30) == 0
