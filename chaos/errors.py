"""One root exception for the chaos suite; every failure a user can act on is one of these."""

from __future__ import annotations

from holdfast_contract.errors import HoldfastError


class ChaosError(HoldfastError):
    """Root of the chaos suite's errors."""


class ScenarioError(ChaosError):
    """The scenario file cannot be used as written (unknown key, fault kind, check, value);
    `problems` holds one line per problem."""

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = problems if problems is not None else [message]


class CheckSyntaxError(ScenarioError):
    """A check expression does not follow `[fault.]metric[.stat] OP number`."""


class CrewError(ChaosError):
    """The supervisor under test did not start, or never reached a whole crew."""


class FaultError(ChaosError):
    """A fault could not be injected (no such process, nothing to target)."""


class CrewTimeout(CrewError):
    """The crew was not whole within the scenario's ready_timeout_s (the run goes on)."""


class VictimAbsent(FaultError):
    """The fault's victim does not exist now, by the policy's own rule (the fault is skipped)."""


class VictimComing(FaultError):
    """The fault's victim is on its way back (a batch engine evicted a moment ago, or
    starting): the trial waits for the crew again, then injects."""
