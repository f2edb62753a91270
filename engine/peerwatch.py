"""Peer liveness for a tensor-parallel group: every rank beats, every rank watches the rest.

A collective whose peer died or stopped can wait forever: NCCL does, and gloo errors only
when a socket closes, not when a peer is SIGSTOPped. So each rank runs a watch on its own
connection to the rendezvous store that rank 0 hosts. Every interval it writes
`holdfast/peerwatch/<rank>` (a counter) and reads the other ranks' counters. A peer whose
counter has not moved for `stale_s`, a store that errors or stops answering (rank 0 gone
or stopped), or a peer that never writes its key: one critical line naming the peer, then
exit 3, the status the engine uses for a broken group.

A rank that stops on purpose calls `stop()` first: it disarms the watch and writes
`holdfast/peerwatch/<rank>/stopped`, so the others do not take its silence for death.
Rank 0, after telling the followers to stop, keeps the store up (`wait_stopped`) until
each has written that mark.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
import urllib.parse
from collections.abc import Mapping
from datetime import timedelta

import structlog
import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from engine.errors import EngineError

log = structlog.get_logger("engine.peerwatch")
PREFIX = "holdfast/peerwatch/"
EXIT_BROKEN = 3  # as Runner: a group missing a rank can never compute again


def store_address(init_method: str, env: Mapping[str, str]) -> tuple[str, int] | None:
    """(host, port) of the TCPStore behind a tcp:// or env:// rendezvous; None otherwise."""
    url = urllib.parse.urlparse(init_method)
    if url.scheme == "tcp" and url.hostname and url.port:
        return url.hostname, url.port
    if url.scheme == "env" and env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return env["MASTER_ADDR"], int(env["MASTER_PORT"])
    return None


class Peer:
    """What this rank last saw of one peer's counter."""

    def __init__(self) -> None:
        self.value: bytes | None = None  # None until the peer's key appears
        self.since = time.monotonic()  # when the value last changed
        self.still = 0  # rounds in a row without a change


class PeerWatch:
    """Two daemon threads: one talks to the store, the other notices when a call hangs."""

    def __init__(
        self,
        address: tuple[str, int],
        rank: int,
        world_size: int,
        *,
        interval_s: float = 0.5,
        stale_s: float = 5.0,
        appear_s: float = 60.0,
    ) -> None:
        self.host, self.port = address
        self.rank, self.world_size = rank, world_size
        self.interval_s, self.stale_s, self.appear_s = interval_s, stale_s, appear_s
        self.limit = max(1, math.ceil(stale_s / interval_s))  # rounds without news
        self.peers = {r: Peer() for r in range(world_size) if r != rank}
        self.rounds = 0  # completed by the store thread; the guard watches it move
        self._stopped = threading.Event()
        self._lock = threading.Lock()  # a stop and an exit never cross
        try:
            self._store = TCPStore(
                self.host, self.port, is_master=False, timeout=timedelta(seconds=stale_s)
            )
        except dist.DistError as e:
            raise EngineError(
                f"peer watch: no rendezvous store at {self.host}:{self.port} ({e}); "
                "every rank needs the same --dist-init"
            ) from e
        self._beater = threading.Thread(target=self._beat, name="peerwatch", daemon=True)
        self._guarder = threading.Thread(target=self._guard, name="peerwatch-guard", daemon=True)

    def start(self) -> None:
        self.started = time.monotonic()
        self._beater.start()
        self._guarder.start()

    def close(self) -> None:
        """Disarm: from here on the watch never ends the process."""
        with self._lock:
            self._stopped.set()

    def stop(self) -> None:
        """This rank stops on purpose: disarm, then mark it so peers don't judge its silence."""
        self.close()
        self._beater.join(self.stale_s)
        if self._beater.is_alive():
            return  # stuck in a store call: nobody is reading marks there
        with contextlib.suppress(dist.DistError):  # gone, with everyone who'd read the mark
            self._store.set(f"{PREFIX}{self.rank}/stopped", "1")

    def wait_stopped(self) -> None:
        """Rank 0, after telling the followers to stop: until each has marked its stop."""
        keys = [f"{PREFIX}{r}/stopped" for r in range(self.world_size) if r != self.rank]
        try:
            self._store.wait(keys, timedelta(seconds=self.stale_s))
        except dist.DistError as e:
            log.warning("followers did not mark their stop", waited_s=self.stale_s, error=str(e))

    # ---- threads ----
    def _beat(self) -> None:
        while not self._stopped.is_set():
            try:
                self._round()
            except RuntimeError as e:  # DistError and its kind
                # gloo sees rank 0's sockets close too, and says so better: one interval first
                if not self._stopped.wait(self.interval_s):
                    self._lost(0, f"rendezvous store {self.host}:{self.port} failed: {e}")
                return
            self.rounds += 1
            self._stopped.wait(self.interval_s)

    def _guard(self) -> None:
        """A store call can block for good (rank 0 SIGSTOPped): no round for stale_s is lost."""
        seen, still = self.rounds, 0
        while not self._stopped.wait(self.interval_s):
            still = still + 1 if self.rounds == seen else 0
            seen = self.rounds
            if still >= self.limit:
                reason = f"rendezvous store {self.host}:{self.port} silent for {self.stale_s:g} s"
                self._lost(0, reason)
                return

    def _round(self) -> None:
        self._store.set(f"{PREFIX}{self.rank}", str(self.rounds))
        for rank in list(self.peers):
            self._look(rank)

    def _look(self, rank: int) -> None:
        key, peer = f"{PREFIX}{rank}", self.peers[rank]
        if peer.value is None and not self._store.check([key]):
            if time.monotonic() - self.started > self.appear_s:
                self._lost(rank, f"never wrote {key} in {self.appear_s:g} s")
            return
        value = self._store.get(key)
        if value != peer.value:
            peer.value, peer.since, peer.still = value, time.monotonic(), 0
            return
        peer.still += 1
        if peer.still < self.limit:
            return
        if self._store.check([f"{key}/stopped"]):
            del self.peers[rank]  # stopped on purpose: rank 0 is stopping this rank too
            return
        self._lost(rank, f"heartbeat unchanged for {time.monotonic() - peer.since:.1f} s")

    def _lost(self, peer: int, reason: str) -> None:
        with self._lock:
            if self._stopped.is_set():
                return  # stopping on purpose: silence is expected now
            log.critical(
                "tensor-parallel peer lost; exiting", rank=self.rank, peer=peer, reason=reason
            )
            os._exit(EXIT_BROKEN)
