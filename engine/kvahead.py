"""A standby's hold on the primary's KV cache ahead of a promotion (`--kv-share`).

Promoted after the primary's death, a standby takes over the dead engine's cache and
ledger (engine/kvshare.py). Asking the keeper for their fds then is a call to the
supervisor while it handles the failover, and relays the cut streams; on a GPU with 16
streams that call took 20 ms, most of the take-over. So while it stands by, a standby
holds dups of the fds of every cache a primary deposited (`ListKV`, every PERIOD_S; a
new deposit under a key is taken again, a key gone is let go). The promotion names the
dead engine's key and which cache the keeper holds under it then (`Promote.kv_ident`):
when the one held is that cache, no call is made. Holding an fd maps nothing and
reserves no memory; it only keeps the cache from being freed, for at most PERIOD_S
after the keeper lets it go.

What is held decides nothing: the adoption checks the cache and ledger as it would
those the keeper gave at the promotion (engine/kvshare.py `adopt`).
"""

from __future__ import annotations

import os
import threading

import structlog

log = structlog.get_logger("engine.kvahead")
PERIOD_S = 0.25  # how often the keeper's list is read


class Ahead:
    """The caches held by a standby: `key` -> (its `kv_ident`, the cache's and ledger's
    fds). `own`, the engine's own key, is never held."""

    def __init__(self, keeper: str, own: str) -> None:
        self.keeper, self.own = keeper, own
        self._held: dict[str, tuple[str, list[int]]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kv-ahead", daemon=True)
        self._thread.start()

    @property
    def keys(self) -> list[str]:
        with self._lock:
            return sorted(self._held)

    def _run(self) -> None:
        from cachedaemon.errors import CacheError
        from holdfast_contract.errors import ProtocolError

        while not self._stop.is_set():
            try:
                self.refresh()
            except (CacheError, ProtocolError, OSError) as e:  # the next round tries again
                log.debug("kv caches not listed", keeper=self.keeper, error=str(e))
            self._stop.wait(PERIOD_S)

    def refresh(self) -> None:
        """One round: hold what the keeper lists that is not held yet, let go of the rest."""
        from cachedaemon import protocol

        reply, _ = protocol.call(self.keeper, protocol.ListKV())
        if not isinstance(reply, protocol.KVList):
            return
        listed = {c.key: c.ident for c in reply.caches if c.key != self.own}
        with self._lock:
            gone = [k for k, (ident, _) in self._held.items() if listed.get(k) != ident]
            old = [self._held.pop(k)[1] for k in gone]
            new = [k for k in listed if k not in self._held]
        for fds in old:
            _close(fds)
        for key in new:
            reply, fds = protocol.call(self.keeper, protocol.ReclaimKV(key), max_fds=2)
            if not isinstance(reply, protocol.KVReclaimed) or len(fds) != 2:
                _close(fds)  # withdrawn since it was listed
                continue
            ident = protocol.kv_ident(fds[0])
            with self._lock:
                if self._stop.is_set():  # taken meanwhile: nothing is held any more
                    _close(fds)
                    return
                self._held[key] = (ident, fds)
            log.info("kv cache held ahead", key=key, ident=ident)

    def take(self, key: str, ident: str) -> list[int] | None:
        """Stop holding: the fds held under `key` when they are the cache `ident` names
        (the keeper's under `key` when the promotion was decided), else None; every
        other fd held is closed."""
        self._stop.set()
        with self._lock:
            held, self._held = self._held, {}
        out = None
        for k, (i, fds) in held.items():
            if k == key and ident and i == ident:
                out = fds
            else:
                _close(fds)
        return out


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
