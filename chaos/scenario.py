"""The scenario file: which policy to run, what load to drive, which faults, which checks.

Validated once, before anything starts: unknown keys are errors with their path, fault
kinds and check expressions are checked against allowlists.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Literal, TypeVar

import msgspec
import yaml

from chaos.checks import Check, parse_check
from chaos.errors import CheckSyntaxError, ScenarioError
from chaos.fleet.kinds import FLEET_FAULTS, FleetConfig, check_problems, config_problems
from chaos.models import ModelRef, model_problems
from supervisor import schema

T = TypeVar("T")
LOAD_FLOORS = {  # key: (floor, whether the floor itself is out)
    "concurrency": (1, False),
    "rate": (0, True),
    "retries": (0, False),
    "max_tokens": (1, False),
    "prompt_tokens": (1, False),
    "stream_fraction": (0, True),
    "twin_prompts": (1, False),
}
LOAD_RANGES = {
    "concurrency": "at least 1",
    "rate": "above 0, or null for back to back",
    "retries": "0 or more",
    "max_tokens": "at least 1",
    "prompt_tokens": "at least 1",
    "stream_fraction": "above 0 (1: every request streamed)",
    "twin_prompts": "at least 1",
}

FAULTS: dict[str, str] = {
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
    "update": "a rolling model update to the next of `models` (supervisor update --model)",
    "refit": "new weights of the same shapes into every engine in place (supervisor refit)",
    **FLEET_FAULTS,
}


class _Spec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pass


class ClientLoad(_Spec, frozen=True):
    """The clients' load of a scenario (`load:`); the policy's `engines.load` is the batch
    rule's thresholds (`supervisor.policy.LoadSpec`)."""

    concurrency: int = 4  # requests in flight
    rate: float | None = 40.0  # at most this many requests/s in all; null: back to back
    max_tokens: int = 2  # output tokens asked for per request
    prompt_tokens: int = 8
    # where the prompt's token ids go: the reference engine's field, or OpenAI's `prompt`
    # (a list of ids; what vLLM reads)
    prompt_key: Literal["prompt_token_ids", "prompt"] = "prompt_token_ids"
    ignore_eos: bool = False  # true: every request generates exactly max_tokens
    timeout_s: float = 5.0  # one attempt
    retries: int = 2  # extra attempts after a failed one
    retry_backoff_ms: float = 20.0
    max_requests: int = 1_000_000  # per stage
    max_duration_s: float = 86_400.0  # per stage
    stream: bool = False  # stream answers (chaos.load checks each stream for completeness)
    stream_fraction: float = 1.0  # with stream: the share of requests streamed
    twin_prompts: int = 8  # streamed requests draw their prompt from this many fixed ones
    # all: collected (non-streamed) requests too, their token ids compared with their twins'
    twins: Literal["streamed", "all"] = "streamed"


class FaultSpec(_Spec, frozen=True):
    kind: str
    trials: int | None = None  # default: the scenario's `trials`
    hold_s: float = 1.0  # SIGSTOP length, broker outage, memory-pressure hold (all taken)
    burst: int = 0  # memory-pressure: requests in the burst (0: engines.load.evict_above + 2)
    # memory-pressure: max_tokens of each burst request; long enough that a batching
    # engine is still busy with the burst when hold_s ends, however fast its steps are
    burst_tokens: int = 400
    # update, refit: the checkpoints it goes to; each trial takes the first that does not
    # serve now (chaos/models.py)
    models: list[ModelRef] = []
    # update, refit: how it must end; rolled-back: a version that must never serve
    expect: Literal["finished", "rolled-back"] = "finished"


class Stage(_Spec, frozen=True):
    name: str
    policy: str  # relative to the scenario file
    faults: list[FaultSpec]
    policy_overrides: dict[str, Any] = {}  # merged onto the policy's keys (mappings by key)


class Scenario(_Spec, frozen=True):
    name: str
    stages: list[Stage]
    checks: list[str] = []
    trials: int = 2
    seed: int = 0
    order: Literal["fixed", "random"] = "fixed"
    load: ClientLoad = ClientLoad()
    warmup_s: float = 1.0
    settle_s: float = 0.3
    trial_timeout_s: float = 20.0
    detect_timeout_s: float = 5.0  # how long a trial waits for the supervisor to notice
    ready_timeout_s: float = 90.0  # per trial: the crew whole again, else the trial fails
    start_timeout_s: float | None = None  # the first whole crew of a stage; null: ready_timeout_s
    # ready standbys a trial waits for, before its fault and after (null: every one the
    # policy wants); fewer lets an engine that starts slowly (vLLM) restart during the
    # next trials while a ready standby still covers each primary fault
    ready_standbys: int | None = None
    # several nodes electing a leader through etcd, in network namespaces (chaos/fleet/):
    # the stage's policy is every node's base; only fleet fault kinds run
    fleet: FleetConfig | None = None


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
    """Read, validate and plan a scenario; ScenarioError lists every problem, each with its
    path in the file and what to change."""
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ScenarioError(f"cannot read scenario {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ScenarioError(f"{path} is not valid YAML: {exc}") from exc
    problems = schema.check(raw, Scenario) if isinstance(raw, dict) else ["$: expected a mapping"]
    problems += _fault_problems(raw) + _load_problems(raw) + config_problems(raw)
    checks: list[Check] = []
    for text in _field(raw, "checks", list):
        try:
            checks.append(parse_check(str(text), faults=FAULTS))
        except CheckSyntaxError as exc:
            problems.append(f"$.checks: {exc}")
    fleet = isinstance(raw, dict) and isinstance(raw.get("fleet"), dict)
    problems += check_problems([(c.text, c.metric, c.stat is not None) for c in checks], fleet)
    if problems:
        raise ScenarioError(f"{path}: " + "\n  ".join(["", *problems]).lstrip(), problems)
    scenario = msgspec.convert(raw, Scenario)
    if seed is not None:
        scenario = msgspec.structs.replace(scenario, seed=seed)
    order = _order(scenario, trials)
    if max_faults is not None:
        order = _truncate(order, max_faults)
    return Plan(scenario, path, checks, order)


def _field(data: object, key: str, kind: type[T]) -> T:
    """data[key] when data is a mapping and the value has the type; else an empty `kind`."""
    value = data.get(key) if isinstance(data, dict) else None
    return value if isinstance(value, kind) else kind()


def _fault_problems(raw: object) -> list[str]:
    stages = _field(raw, "stages", list)
    if not stages:
        return ["$.stages: empty or missing; list at least one stage with faults"]
    problems = []
    fleet = isinstance(raw, dict) and isinstance(raw.get("fleet"), dict)
    for i, stage in enumerate(stages):
        for j, fault in enumerate(_field(stage, "faults", list)):
            kind = _field(fault, "kind", str)
            where = f"$.stages[{i}].faults[{j}].kind"
            if kind and kind not in FAULTS:
                problems.append(
                    f"{where}: unknown fault kind {kind!r}; valid kinds: {', '.join(FAULTS)}"
                )
            elif kind in FLEET_FAULTS and not fleet:
                problems.append(
                    f"{where}: {kind} is a fleet fault; add a `fleet:` section (nodes, ttl_s) "
                    "to the scenario, or drop the fault"
                )
            elif kind and fleet and kind not in FLEET_FAULTS:
                problems.append(
                    f"{where}: {kind} is a single-node fault and this scenario runs a fleet; "
                    f"fleet kinds: {', '.join(FLEET_FAULTS)}"
                )
            problems += model_problems(fault, f"$.stages[{i}].faults[{j}]")
            trials = fault.get("trials") if isinstance(fault, dict) else None
            if isinstance(trials, int) and trials < 0:
                problems.append(f"$.stages[{i}].faults[{j}].trials: must be 0 or more")
    return problems


def _load_problems(raw: object) -> list[str]:
    load = _field(raw, "load", dict)
    problems = []
    for key, (least, strict) in LOAD_FLOORS.items():
        value = load.get(key)
        if isinstance(value, int | float) and (value <= least if strict else value < least):
            problems.append(f"$.load.{key}: {value!r} is out of range ({LOAD_RANGES[key]})")
    return problems


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
