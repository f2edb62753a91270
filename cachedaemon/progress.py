"""Progress for long loads: a rich bar with GB/s on a terminal, periodic log lines otherwise."""

from __future__ import annotations

import sys
import time

import structlog
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

log = structlog.get_logger("cachedaemon.progress")


class ByteProgress:
    def __init__(self, label: str, total: int | None = None, every_s: float = 5.0) -> None:
        self.label = label
        self.total = total
        self.done = 0
        self._every = every_s
        self._t0 = self._last = time.perf_counter()
        self._bar: Progress | None = None
        self._task: TaskID | None = None
        if sys.stderr.isatty():
            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=Console(stderr=True),
                transient=True,
            )

    def __enter__(self) -> ByteProgress:
        if self._bar is not None:
            self._bar.start()
            self._task = self._bar.add_task(self.label, total=self.total)
        return self

    def set_total(self, total: int) -> None:
        self.total = total
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, total=total)

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, advance=nbytes)
            return
        now = time.perf_counter()
        if now - self._last >= self._every:
            self._last = now
            log.info(self.label, gb=round(self.done / 1e9, 2), gb_per_s=self.rate())

    def rate(self) -> float:
        return round(self.done / 1e9 / max(time.perf_counter() - self._t0, 1e-9), 3)

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()
        if exc_type is None:
            log.info(f"{self.label}: done", gb=round(self.done / 1e9, 3), gb_per_s=self.rate())
        else:  # the caller reports the error; say only how far it got
            log.warning(f"{self.label}: stopped", gb=round(self.done / 1e9, 3))
