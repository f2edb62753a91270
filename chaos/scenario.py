"""The scenario file: which policy to run, what load to drive, which faults, which checks.

Validated once, before anything starts: unknown keys are errors with their path, fault
kinds and check expressions are checked against allowlists.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Literal

import msgspec
import yaml

from chaos.checks import Check, parse_check
from chaos.errors import ScenarioError

FAULT_KINDS: dict[str, str] = {
    "kill-primary": "SIGKILL the primary engine",
    "stop-primary": "SIGSTOP the primary engine (a hang)",
    "kill-standby": "SIGKILL one standby engine",
    "stop-standby": "SIGSTOP one standby engine",
    "kill-batch": "SIGKILL one batch engine",
    "stop-batch": "SIGSTOP one batch engine",
    "kill-daemon": "SIGKILL the cache daemon of rank 0",
    "stop-daemon": "SIGSTOP the cache daemon of rank 0",
    "kill-tp-rank": "SIGKILL the last rank of the primary's tensor-parallel group",
    "kill-daemon-and-primary": "SIGKILL the rank-0 daemon and the primary together",
    "restart-broker": "stop the suite's own MQTT broker, then start it again",
    "kill-supervisor": "SIGKILL the supervisor, then start it again with the same policy",
    "memory-pressure": "a burst of long requests (KV-cache pressure) that evicts batch engines",
}


class _Spec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pass


class LoadSpec(_Spec, frozen=True):
    concurrency: int = 4
    rate: float = 40.0  # requests per second, all workers together
    max_tokens: int = 2
    prompt_tokens: int = 8
    timeout_s: float = 5.0  # one attempt
    retries: int = 2  # extra attempts after a failed one
    retry_backoff_ms: float = 20.0
    max_requests: int = 1_000_000  # per stage
    max_duration_s: float = 86_400.0  # per stage


class FaultSpec(_Spec, frozen=True):
    kind: str
    trials: int | None = None  # default: the scenario's `trials`
    hold_s: float = 1.0  # SIGSTOP length, broker outage, memory-pressure burst length
    burst: int = 0  # memory-pressure: requests in the burst (0: engines.load.evict_above + 2)
    burst_tokens: int = 16  # memory-pressure: max_tokens of each burst request


class Stage(_Spec, frozen=True):
    name: str
    policy: str  # relative to the scenario file
    faults: list[FaultSpec]


class Scenario(_Spec, frozen=True):
    name: str
    stages: list[Stage]
    checks: list[str] = []
    trials: int = 2
    seed: int = 0
    order: Literal["fixed", "random"] = "fixed"
    load: LoadSpec = LoadSpec()
    warmup_s: float = 1.0
    settle_s: float = 0.3
    trial_timeout_s: float = 20.0
    detect_timeout_s: float = 5.0  # how long a trial waits for the supervisor to notice
    ready_timeout_s: float = 90.0


class Plan(msgspec.Struct, frozen=True):
    """A validated scenario with its checks parsed and its fault order drawn."""

    scenario: Scenario
    source: Path
    checks: list[Check]
    order: list[list[FaultSpec]]  # per stage, in injection order

    def policy_path(self, stage: Stage) -> Path:
        path = Path(stage.policy)
        return path if path.is_absolute() else (self.source.parent / path).resolve()

    @property
    def total_faults(self) -> int:
        return sum(len(faults) for faults in self.order)


def load_scenario(
    path: Path,
    *,
    trials: int | None = None,
    seed: int | None = None,
    max_faults: int | None = None,
) -> Plan:
    """Read, validate and plan a scenario; raises ScenarioError naming what to change."""
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ScenarioError(f"cannot read scenario {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ScenarioError(f"{path} is not valid YAML: {exc}") from exc
    try:
        scenario = msgspec.convert(raw, Scenario)
    except msgspec.ValidationError as exc:
        raise ScenarioError(f"{path}: {exc}") from exc
    if seed is not None:
        scenario = msgspec.structs.replace(scenario, seed=seed)
    _validate(scenario, path)
    checks = [parse_check(text, fault_kinds=FAULT_KINDS) for text in scenario.checks]
    order = _order(scenario, trials)
    if max_faults is not None:
        order = _truncate(order, max_faults)
    return Plan(scenario, path, checks, order)


def _validate(scenario: Scenario, path: Path) -> None:
    if not scenario.stages:
        raise ScenarioError(f"{path}: $.stages is empty; list at least one stage with faults")
    for i, stage in enumerate(scenario.stages):
        for j, fault in enumerate(stage.faults):
            if fault.kind not in FAULT_KINDS:
                raise ScenarioError(
                    f"{path}: $.stages[{i}].faults[{j}].kind: unknown fault kind "
                    f"{fault.kind!r}; valid kinds: {', '.join(FAULT_KINDS)}"
                )
            if fault.trials is not None and fault.trials < 0:
                raise ScenarioError(f"{path}: $.stages[{i}].faults[{j}].trials must be >= 0")
    load = scenario.load
    if load.concurrency < 1 or load.rate <= 0 or load.retries < 0:
        raise ScenarioError(f"{path}: $.load needs concurrency >= 1, rate > 0 and retries >= 0")


def _order(scenario: Scenario, trials: int | None) -> list[list[FaultSpec]]:
    rng = random.Random(scenario.seed)
    order = []
    for stage in scenario.stages:
        faults = [fault for fault in stage.faults for _ in range(_trials(scenario, fault, trials))]
        if scenario.order == "random":
            rng.shuffle(faults)
        order.append(faults)
    return order


def _truncate(order: list[list[FaultSpec]], limit: int) -> list[list[FaultSpec]]:
    """The first `limit` faults of the drawn order (a shorter run of the same sequence)."""
    out = []
    for faults in order:
        out.append(faults[: max(limit, 0)])
        limit -= len(out[-1])
    return out


def _trials(scenario: Scenario, fault: FaultSpec, override: int | None) -> int:
    if override is not None:
        return override
    return fault.trials if fault.trials is not None else scenario.trials
