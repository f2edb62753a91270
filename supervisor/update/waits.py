"""What an update waits for before its switch, and how it says why it gave up: a new
engine that is a ready standby, the heir (`heir`, NotReady once one is quarantined), a
pool that is not the version already served (SameVersion), within
update.ready_timeout_s (`why`)."""

from __future__ import annotations

from supervisor.states import EngineState
from supervisor.units import Engine


class NotReady(Exception):
    """A new version's engine was quarantined before it was ready."""


class SameVersion(Exception):
    """The pool built is the version that serves (the same bytes in another dir)."""


def heir(engines: list[Engine]) -> Engine | None:
    """The first new engine that is a ready standby (None: none yet); NotReady once one is
    quarantined, so a version whose engines cannot start is rolled back."""
    for e in engines:
        if e.state == EngineState.QUARANTINED:
            raise NotReady(f"engine {e.name} was quarantined before it was ready")
    return next((e for e in engines if e.state == EngineState.STANDBY), None)


def why(e: Exception, timeout_s: float) -> str:
    """Why an update was rolled back, for its event and `supervisor status`."""
    if isinstance(e, TimeoutError):
        return (
            f"the new version was not ready within update.ready_timeout_s ({timeout_s:g} s): "
            "its daemons or engines did not start; see their logs under <run>/gen-<n>/logs "
            "and <run>/logs"
        )
    return str(e)
