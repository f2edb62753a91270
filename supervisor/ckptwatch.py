"""The checkpoint files a serving pool was loaded from, watched on disk.

Each daemon's status says which files (by their stat facts: size, mtime, ctime, inode,
device) its pool was loaded from. An inotify watch on the model dir wakes `run` at any
change there; it compares the files as they are now with each daemon's, and reports a
daemon whose files changed once per change (`daemon.<rank>.checkpoint_changed`), and
each engine start on such a pool (`daemon.<rank>.stale_handout`). Reads no file, only
stats them. Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from holdfast_contract.events import EventName as N
from supervisor.events import EventBus
from supervisor.fswatch import CHANGES, DirWatch
from supervisor.states import DaemonState
from supervisor.units import Daemon
from supervisor.wiring import Term

if TYPE_CHECKING:
    from cachedaemon.config import CacheConfig
    from cachedaemon.protocol import StatusReply

log = structlog.get_logger("supervisor.ckptwatch")


class CheckpointWatch:
    """Which files each rank's pool was loaded from, and whether they are still those."""

    def __init__(self, model_dir: Path, bus: EventBus, term: Term) -> None:
        self.model_dir = model_dir
        self.bus = bus
        self.term = term  # the epoch its events carry
        self._loaded: dict[int, CacheConfig] = {}

    def loaded(self, d: Daemon, status: StatusReply | None) -> None:
        """Rank d serves again: its pool's files are those its status names."""
        if status is None:
            self._loaded.pop(d.rank, None)
        else:
            self._loaded[d.rank] = status.config
        self.check(d)

    def changes(self, d: Daemon) -> list[str]:
        """One line per file that is not what rank d's pool was loaded from."""
        import msgspec

        from cachedaemon.config import checkpoint_changes, checkpoint_identity
        from cachedaemon.errors import CacheError

        served = self._loaded.get(d.rank)
        if served is None:
            return []
        try:
            now = checkpoint_identity(self.model_dir)
        except (CacheError, OSError) as e:  # removed or being replaced right now
            return [str(e)]
        return checkpoint_changes(msgspec.structs.replace(served, checkpoint=now), served)

    def check(self, d: Daemon) -> None:
        changed = tuple(self.changes(d))
        if changed == d.checkpoint_changed:
            return
        d.checkpoint_changed = changed
        if not changed:
            log.info("checkpoint files are those the pool was loaded from", rank=d.rank)
            return
        log.warning(
            "the checkpoint changed on disk since this pool was loaded; engines started "
            "now refuse it or load from disk, until the daemon restarts and loads it again",
            rank=d.rank,
            files=list(changed),
        )
        self.bus.emit(
            "daemon", str(d.rank), N.CHECKPOINT_CHANGED, self.term.epoch, files=list(changed)
        )

    def before_handout(self, daemons: Sequence[Daemon], engine: str) -> None:
        """Say so for each serving pool whose checkpoint changed, as `engine` starts."""
        for d in daemons:
            if d.state != DaemonState.SERVING or not d.checkpoint_changed:
                continue
            files = list(d.checkpoint_changed)
            log.warning(
                "engine starts against a pool whose checkpoint changed on disk",
                engine=engine,
                rank=d.rank,
                files=files,
            )
            self.bus.emit(
                "daemon", str(d.rank), N.STALE_HANDOUT, self.term.epoch, engine=engine, files=files
            )

    async def run(self, daemons: Sequence[Daemon]) -> None:
        """Check every daemon at each change in the model dir, until cancelled."""
        watch = DirWatch(self.model_dir, CHANGES)
        try:
            while True:
                await watch.changed()
                for d in daemons:
                    self.check(d)
        finally:
            watch.close()
