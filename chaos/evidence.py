"""What a trial can prove beyond timings: the order of the supervisor's events (a hung
primary fenced before its standby is promoted) and, from the daemons' own logs, how many
checkpoint bytes a daemon that took over read (0 when it served from escrow)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from chaos.recorder import EventRow
from holdfast_contract.events import EventName

BYTES_READ = re.compile(r"checkpoint_bytes_read\"?\s*[=:]\s*(\d+)")  # key=value or JSON


def fence_before_promote(events: Sequence[EventRow], victim: str, since: float) -> float | None:
    """1.0 when the victim's `fenced` event came before the first `promoted` after `since`
    in the supervisor's own stream (zmq, in publish order); 0.0 when the promotion came
    first or no fence was published; None when nothing was promoted."""
    stream = [e for e in events if e.source == "zmq" and e.ts >= since]
    promoted = next((i for i, e in enumerate(stream) if e.event == EventName.PROMOTED), None)
    if promoted is None:
        return None
    fenced = next(
        (i for i, e in enumerate(stream) if e.event == EventName.FENCED and e.name == victim), None
    )
    return 1.0 if fenced is not None and fenced < promoted else 0.0


class DaemonLogs:
    """The daemons' log files under `<run>/logs`, read from a mark onwards."""

    def __init__(self, run_dir: Path) -> None:
        self.dir = run_dir / "logs"
        self.mark: dict[Path, int] = {}

    def set_mark(self) -> None:
        self.mark = {path: path.stat().st_size for path in self._files()}

    def bytes_read_since_mark(self) -> float | None:
        """Checkpoint bytes read by every daemon that loaded a pool since the mark (its
        `pool ready` line); None when no daemon loaded one since."""
        found: list[int] = []
        for path in self._files():
            with path.open("rb") as log:
                log.seek(self.mark.get(path, 0))
                text = log.read().decode(errors="replace")
            for line in text.splitlines():
                match = BYTES_READ.search(line) if "pool ready" in line else None
                found += [int(match[1])] if match else []
        return float(sum(found)) if found else None

    def _files(self) -> list[Path]:
        return sorted(self.dir.glob("daemon-*.log")) if self.dir.is_dir() else []
