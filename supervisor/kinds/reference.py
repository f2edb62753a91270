"""`engines.kind: holdfast`: `engines.command` as given, the reference engine
(`{python} -m engine`) by default; readiness and health from the agent, or from
`GET /health` with `engines.health: http`. It has no section of its own. Unless the policy
says `engines.forkserver: false`, engines whose command is `{python} -m engine ...` fork
from engine.forkserver, which has imported torch and the engine once.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from holdfast_contract.command import FORKABLE, is_forkable
from supervisor.kinds.base import Forks, Kind

if TYPE_CHECKING:
    from supervisor.policy import Policy

FORKABLE_ARGV = [arg.format(python=sys.executable) for arg in FORKABLE]  # what forks serve


class Reference(Kind):
    name = "holdfast"

    def errors(self, p: Policy, *, schema_only: bool) -> list[str]:
        e = p.engines
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
        return Forks([sys.executable, "-m", "engine.forkserver"], FORKABLE_ARGV, "forkserver")


KIND = Reference()
