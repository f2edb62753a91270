"""`engines.kind: holdfast`: `engines.command` as given, the reference engine
(`{python} -m engine`) by default; readiness and health from the agent, or from
`GET /health` with `engines.health: http`. It has no section of its own. Unless the policy
says `engines.forkserver: false`, engines whose command is `{python} -m engine ...` fork
from engine.forkserver, which has imported torch and the engine once, and keeps the spares
`engines.spares` asks for (a ready spare makes a restart a hand-over: engine/ready.py).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from holdfast_contract.command import FORKABLE, is_forkable
from supervisor.kinds.base import Forks, Kind
from supervisor.policy import spares_mode

if TYPE_CHECKING:
    from supervisor.policy import Policy

FORKABLE_ARGV = [arg.format(python=sys.executable) for arg in FORKABLE]  # what forks serve


class Reference(Kind):
    name = "holdfast"

    def errors(self, p: Policy, *, schema_only: bool) -> list[str]:
        e, spares = p.engines, spares_mode(p.engines)
        if spares in ("on", "ready") and self.forks(p) is None:
            return [
                f"$.engines.spares: {spares} needs the engine fork server, which forks "
                f"engines whose command is {' '.join(FORKABLE)} while engines.forkserver is "
                "not false; leave engines.spares unset or fork the engines"
            ]
        if e.forkserver and not is_forkable(e.command):
            return [
                f"$.engines.forkserver: true needs engines.command to start with "
                f"{' '.join(FORKABLE)} (got {' '.join(e.command[:3])!r}); set it to "
                "false or leave it unset"
            ]
        return []

    def forks(self, p: Policy) -> Forks | None:
        """engine.forkserver, unless the policy says false, when an engine command is
        `{python} -m engine ...`."""
        if p.engines.forkserver is False:
            return None
        commands = [p.engines.command, *(b.command for b in p.engines.batch if b.command)]
        if not any(is_forkable(c) for c in commands):
            return None
        server = [sys.executable, "-m", "engine.forkserver", "--spares", spares_mode(p.engines)]
        return Forks(server, FORKABLE_ARGV, "forkserver")


KIND = Reference()
