"""One root exception for the supervisor; every failure a user can act on is one of these."""

from __future__ import annotations

from holdfast_contract.errors import HoldfastError


class SupervisorError(HoldfastError):
    """Root of the supervisor's errors."""


class PolicyError(SupervisorError):
    """The policy file is invalid; `errors` holds one `$.path: message` line per problem."""

    def __init__(self, errors: list[str], source: str = "policy") -> None:
        self.errors = list(errors)
        self.source = source
        super().__init__(f"{source}: " + "; ".join(self.errors))


class ControlError(SupervisorError):
    """A control command failed: no supervisor on the runtime dir, or it refused the command."""


class RuntimeDirError(SupervisorError):
    """The runtime dir is unusable: wrong owner, wrong mode, or held by a live supervisor."""


class StartupError(SupervisorError):
    """A daemon or engine did not come up; the message says which and what it printed."""
