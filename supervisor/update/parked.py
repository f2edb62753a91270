"""Cache daemons started ahead of the next update or refit (`update.park`).

A new generation's daemon used to start from nothing when the command came: imports
(torch: 3-5 s on a GPU machine) and a CUDA context before its first byte was read. With
`update.park` each rank keeps one `cachedaemon park` process (cachedaemon/park.py) that
has done both and waits on `<run>/parked-<rank>.sock`. A generation's spawn claims it:
the parked process is handed the `serve` command line and the generation's log, and
starts loading at once; another is parked in its place for the next time. A parked process
that is not there, not listening yet within `WAIT_S`, or runs another python than the
command asks for, is not used: the daemon starts as before.

What it costs while it waits: a process with torch imported, and on a GPU a CUDA context
(about 0.5 GB of device memory). `auto` parks on CUDA devices only, where the start is
slow; CPU daemons start in about a second."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import structlog

from cachedaemon import park
from supervisor.errors import StartupError
from supervisor.kinds import kind_of
from supervisor.policy import Policy
from supervisor.procs import Proc
from supervisor.units import Daemon
from supervisor.watcher import Command, Watcher

log = structlog.get_logger("supervisor.update")
WAIT_S = 10.0  # a claim waits this long for a parked daemon still importing


def wanted(p: Policy) -> bool:
    """Whether the policy parks daemons (`update.park`; auto: on CUDA devices)."""
    if isinstance(p.update.park, bool):
        return p.update.park
    return any(d.startswith("cuda") for d in p.devices.ids)


class Parked:
    """One parked daemon per rank of the first generation's daemons (their devices)."""

    def __init__(self, policy: Policy, run: Path, watcher: Watcher) -> None:
        self.policy, self.run, self.watcher = policy, run, watcher
        self.on = wanted(policy)
        self.procs: dict[int, Proc] = {}
        self.stopping = False
        self.python, _ = kind_of(policy).daemon_runtime(policy)

    def socket(self, rank: int) -> Path:
        return self.run / f"parked-{rank}.sock"

    def command(self, d: Daemon) -> Command:
        argv = [self.python, "-m", "cachedaemon", "--log-format", "json", "park"]
        argv += ["--claim", str(self.socket(d.rank)), "--device", d.device]
        argv += ["--backend", self.policy.cache.backend]
        log_path = self.run / "logs" / f"daemon-{d.rank}-parked.log"
        return Command(argv, dict(os.environ), log_path)

    async def start(self, daemons: list[Daemon]) -> None:
        for d in daemons:
            await self.park(d)

    async def park(self, d: Daemon) -> None:
        """A parked daemon for rank `d`, unless one is there (or parking is off)."""
        old = self.procs.get(d.rank)
        if not self.on or self.stopping or (old is not None and old.alive):
            return
        try:
            self.procs[d.rank] = await Watcher.spawn(self.command(d))
        except StartupError as e:  # no parked daemon: the next pool's starts as before
            log.warning("daemon not parked", rank=d.rank, why=str(e))

    async def claim(self, d: Daemon, cmd: Command) -> Proc | None:
        """Rank `d`'s parked daemon, running `cmd` (a `cachedaemon serve` command line)
        from now on; None if there is none to hand it to."""
        proc = self.procs.pop(d.rank, None)
        if proc is None or not proc.alive or cmd.argv[:3] != [self.python, "-m", "cachedaemon"]:
            if proc is not None and proc.alive:
                self.procs[d.rank] = proc
            return None
        t0 = time.monotonic()
        start = cmd.log.stat().st_size if cmd.log.exists() else 0
        pid = None
        while pid is None and proc.alive and time.monotonic() - t0 < WAIT_S:
            pid = await asyncio.to_thread(park.claim, self.socket(d.rank), cmd.argv[3:], cmd.log)
            if pid is None:
                await asyncio.sleep(0.02)
        if pid != proc.pid:
            log.warning("parked daemon not claimed", rank=d.rank, pid=proc.pid, alive=proc.alive)
            await proc.terminate(grace=1.0)
            return None
        log.info(
            "parked daemon claimed",
            rank=d.rank,
            pid=pid,
            ms=round((time.monotonic() - t0) * 1e3, 1),
        )
        self.watcher.own(self.park(d))  # the next one, for the update after this
        return proc.moved(cmd.argv, cmd.log, start)

    async def stop(self) -> None:
        self.stopping = True
        procs, self.procs = list(self.procs.values()), {}
        await asyncio.gather(*(p.terminate(grace=2.0) for p in procs))
