"""The keeper: holds every daemon's pool fds in escrow, so a pool outlives its daemon.

Torch-free and CUDA-free: it only keeps file descriptors open. The supervisor embeds a
`Keeper`; `cachedaemon keeper --socket PATH` runs one standalone.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import structlog

import cachedaemon.protocol as protocol
from cachedaemon.frameserver import FrameServer, Reply
from cachedaemon.manifest import Manifest
from cachedaemon.rundir import claim, listen, prepare, write_json_atomic
from holdfast_contract import wire

log = structlog.get_logger("cachedaemon.keeper")
MAX_POOL_BYTES = 2**63 - 1  # a pool size a reply can carry


def _dup_all(fds: list[int]) -> list[int]:
    dups: list[int] = []
    try:
        for fd in fds:
            dups.append(os.dup(fd))
    except OSError:
        wire.close_fds(dups)
        raise
    return dups


class _Escrow:
    def __init__(self, manifest: Manifest, fds: list[int]) -> None:
        self.manifest = manifest
        self.fds = fds
        self.deposited_at = time.time()
        self.reclaims = 0


class Keeper:
    """Serves Deposit / Reclaim / Withdraw / ListPools, and engines' KV caches (DepositKV /
    ReclaimKV / WithdrawKV / ListKV), on a unix socket from a thread."""

    def __init__(self, socket_path: str | Path, *, read_timeout: float = 5.0) -> None:
        self.socket_path = Path(socket_path)
        self._pools: dict[str, _Escrow] = {}
        self._kv: dict[str, list[int]] = {}  # engines' KV caches and ledgers, by key
        self._kv_primary: set[str] = set()  # those deposited by a primary (ListKV)
        self._lock = threading.Lock()
        self._timeout = read_timeout
        self._server: FrameServer | None = None

    def start(self) -> Keeper:
        run = prepare(self.socket_path.parent)
        ready = run / (self.socket_path.name + ".ready")
        claim(self.socket_path, ready, f"keeper {self.socket_path}")
        sock = listen(self.socket_path)
        self._server = FrameServer(
            sock,
            self._handle,
            read_timeout=self._timeout,
            max_fds=wire.MAX_FDS,
            close_reply_fds=True,
        )
        self._server.start()
        write_json_atomic(ready, {"pid": os.getpid(), "socket": str(self.socket_path)})
        log.info("keeper serving", socket=str(self.socket_path))
        return self

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        self.socket_path.unlink(missing_ok=True)
        Path(str(self.socket_path) + ".ready").unlink(missing_ok=True)
        with self._lock:
            for esc in self._pools.values():
                wire.close_fds(esc.fds)
            self._pools.clear()
            for fds in self._kv.values():
                wire.close_fds(fds)
            self._kv.clear()
            self._kv_primary.clear()

    def __enter__(self) -> Keeper:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def pools(self) -> list[protocol.PoolInfo]:
        with self._lock:
            return [
                protocol.PoolInfo(fp, e.manifest.pool_bytes, len(e.fds), e.deposited_at, e.reclaims)
                for fp, e in self._pools.items()
            ]

    def withdraw(self, fingerprint: str) -> bool:
        """Drop a pool from escrow (its fds closed); whether it was there."""
        with self._lock:
            gone = self._pools.pop(fingerprint, None)
        if gone is None:
            return False
        wire.close_fds(gone.fds)
        log.info("pool withdrawn", fingerprint=fingerprint)
        return True

    def kv_keys(self) -> list[str]:
        with self._lock:
            return list(self._kv)

    def kv_ident(self, key: str) -> str:
        """Which cache the keeper holds under `key` now (`protocol.kv_ident`); "": none."""
        with self._lock:
            kv = self._kv.get(key)
            return protocol.kv_ident(kv[0]) if kv is not None else ""

    def withdraw_kv(self, key: str) -> bool:
        """Drop an engine's KV cache and ledger from escrow; whether they were there."""
        with self._lock:
            gone = self._kv.pop(key, None)
            self._kv_primary.discard(key)
        if gone is None:
            return False
        wire.close_fds(gone)
        log.info("kv withdrawn", key=key)
        return True

    def _handle(self, msg: protocol._Msg, fds: list[int]) -> Reply:
        if isinstance(msg, protocol.Deposit):
            return self._deposit(msg, fds)
        if isinstance(msg, protocol.DepositKV):
            if len(fds) != 2:
                wire.close_fds(fds)
                return protocol.ErrorReply(
                    f"a KV deposit carries 2 fds (the cache, its ledger), not {len(fds)}"
                ), []
            with self._lock:
                old = self._kv.pop(msg.key, None)
                self._kv[msg.key] = fds
                if msg.primary:
                    self._kv_primary.add(msg.key)
                else:
                    self._kv_primary.discard(msg.key)
            if old is not None:
                wire.close_fds(old)
            log.info("kv deposited", key=msg.key, primary=msg.primary)
            return protocol.Ok(), []
        wire.close_fds(fds)  # only a deposit carries fds
        if isinstance(msg, protocol.Reclaim):
            with self._lock:
                esc = self._pools.get(msg.fingerprint)
                if esc is None:
                    return protocol.NotFound(msg.fingerprint), []
                esc.reclaims += 1
                log.info("pool reclaimed", fingerprint=msg.fingerprint, reclaims=esc.reclaims)
                # dups, taken under the lock: a withdraw or a new deposit of this pool may
                # close the escrow's own fds before the reply is sent
                return protocol.Reclaimed(esc.manifest), _dup_all(esc.fds)
        if isinstance(msg, protocol.Withdraw):
            self.withdraw(msg.fingerprint)
            return protocol.Ok(), []
        if isinstance(msg, protocol.ReclaimKV):
            with self._lock:
                kv = self._kv.get(msg.key)
                if kv is None:
                    return protocol.NotFound(msg.key), []
                return protocol.KVReclaimed(msg.key), _dup_all(kv)
        if isinstance(msg, protocol.WithdrawKV):
            self.withdraw_kv(msg.key)
            return protocol.Ok(), []
        if isinstance(msg, protocol.ListKV):
            with self._lock:
                held = [
                    protocol.KVHeld(k, protocol.kv_ident(self._kv[k][0]))
                    for k in sorted(self._kv_primary)
                ]
            return protocol.KVList(held), []
        if isinstance(msg, protocol.ListPools):
            return protocol.Pools(self.pools()), []
        return protocol.ErrorReply(f"the keeper does not answer {type(msg).__name__}"), []

    def _deposit(self, msg: protocol.Deposit, fds: list[int]) -> Reply:
        if len(fds) != len(msg.manifest.chunks):
            wire.close_fds(fds)
            return protocol.ErrorReply(
                f"deposit carries {len(fds)} fds for {len(msg.manifest.chunks)} chunks"
            ), []
        sizes = [c.size for c in msg.manifest.chunks]
        if min(sizes, default=0) < 0 or sum(sizes) > MAX_POOL_BYTES:  # ListPools must carry it
            wire.close_fds(fds)
            return protocol.ErrorReply(
                f"deposit's chunk sizes must be >= 0 and add up to at most {MAX_POOL_BYTES}"
            ), []
        with self._lock:
            old = self._pools.pop(msg.manifest.fingerprint, None)
            self._pools[msg.manifest.fingerprint] = _Escrow(msg.manifest, fds)
        if old is not None:
            wire.close_fds(old.fds)
        log.info(
            "pool deposited",
            fingerprint=msg.manifest.fingerprint,
            chunks=len(fds),
            pool_bytes=msg.manifest.pool_bytes,
        )
        return protocol.Ok(), []
