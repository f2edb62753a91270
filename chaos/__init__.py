"""Fault harness: drives load through the router, injects faults, measures recovery."""

from __future__ import annotations

from chaos.errors import ChaosError, CheckSyntaxError, CrewError, FaultError, ScenarioError

__all__ = ["ChaosError", "CheckSyntaxError", "CrewError", "FaultError", "ScenarioError"]
