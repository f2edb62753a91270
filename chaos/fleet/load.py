"""Clients that send requests through the fleet's routers and log every response.

Each client is a thread inside a namespace (the client namespace, or a node's own), bound
to one node's router. A row per attempt: when it was sent and answered (CLOCK_MONOTONIC),
the status, and the headers that say who answered (X-Holdfast-Node, its cluster epoch and
its engine's epoch). A client does not retry: retrying before the first byte is the
routers' job, so every failure a client sees counts.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Callable

import msgspec

from chaos.fleet.net import enter

REQUEST_TIMEOUT_S = 15.0
AFTER_ERROR_S = 0.05  # a refused connection returns at once: do not spin on a dead router


class Row(msgspec.Struct, frozen=True, array_like=True):
    client: int
    ns: str  # the namespace the client runs in
    router: str  # the node whose router it sent to
    sent: float  # CLOCK_MONOTONIC
    answered: float
    status: int  # 0: no HTTP answer (connection refused, reset, timeout)
    node: str  # X-Holdfast-Node
    cluster_epoch: int  # X-Holdfast-Cluster-Epoch
    epoch: int  # X-Holdfast-Epoch
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200


class Clients:
    """Client threads; `rows` grows as answers come; `wait` blocks on a condition over it."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.rows: list[Row] = []
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._paused: dict[int, threading.Event] = {}
        self._stale: set[int] = set()  # paused clients whose connection is to be made anew

    def add(self, ns: str, router: str, address: str) -> int:
        """A client in `ns` sending to `address` (HOST:PORT, the router of node `router`)."""
        index = len(self._threads)
        running = threading.Event()
        running.set()
        self._paused[index] = running
        thread = threading.Thread(
            target=self._run, args=(index, ns, router, address), daemon=True, name=f"client{index}"
        )
        self._threads.append(thread)
        thread.start()
        return index

    def _run(self, index: int, ns: str, router: str, address: str) -> None:
        enter(ns)
        host, _, port = address.partition(":")
        body = json.dumps({"prompt": "fleet"})
        conn: http.client.HTTPConnection | None = None
        while not self._stop.is_set():
            self._paused[index].wait()
            with self._cond:
                stale = index in self._stale
                self._stale.discard(index)
            if stale and conn is not None:
                conn.close()  # kept alive to a router that may have died while paused
                conn = None
            if conn is None:
                conn = http.client.HTTPConnection(host, int(port), timeout=REQUEST_TIMEOUT_S)
            sent = time.monotonic()
            try:
                conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                resp.read()
                h = resp.headers
                row = Row(
                    index, ns, router, sent, time.monotonic(), resp.status,
                    h.get("X-Holdfast-Node", ""), _int(h.get("X-Holdfast-Cluster-Epoch")),
                    _int(h.get("X-Holdfast-Epoch")),
                )  # fmt: skip
            except (OSError, http.client.HTTPException) as exc:
                row = Row(index, ns, router, sent, time.monotonic(), 0, "", 0, 0, repr(exc)[:200])
                conn.close()
                conn = None
            with self._cond:
                self.rows.append(row)
                self._cond.notify_all()
            self._stop.wait(self.interval_s if row.status else max(self.interval_s, AFTER_ERROR_S))
        if conn is not None:
            conn.close()

    def pause(self, index: int) -> None:
        """Stop sending from client `index` after its current request (its router's node is
        about to be killed: a client of a dead router measures nothing). It connects anew
        when it resumes: its kept-alive connection may be to a router that died meanwhile,
        and a first request on it would fail in whichever trial comes next."""
        with self._cond:
            self._stale.add(index)
        self._paused[index].clear()

    def resume(self, index: int) -> None:
        self._paused[index].set()

    def mark(self) -> int:
        with self._cond:
            return len(self.rows)

    def since(self, mark: int) -> list[Row]:
        with self._cond:
            return self.rows[mark:]

    def wait(self, pred: Callable[[Row], bool], timeout: float, after: int = 0) -> Row | None:
        """The first row at index >= `after` for which `pred` holds, or None at the deadline."""
        deadline = time.monotonic() + timeout
        seen = after
        with self._cond:
            while True:
                for row in self.rows[seen:]:
                    if pred(row):
                        return row
                seen = len(self.rows)
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def close(self) -> None:
        self._stop.set()
        for running in self._paused.values():
            running.set()
        for thread in self._threads:
            thread.join(REQUEST_TIMEOUT_S + 5)


def _int(value: str | None) -> int:
    try:
        return int(value) if value else 0
    except ValueError:
        return -1
