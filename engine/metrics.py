"""Counters the engine exposes at GET /metrics, in Prometheus text format."""

from __future__ import annotations

import collections
import time

import msgspec

from engine.job import Stats

WINDOW_S = 10.0


class Phases(msgspec.Struct):
    """Where startup went, in ms from the engine's first line of Python."""

    imports: float = 0.0
    context_init: float = 0.0  # torch.distributed / CUDA context
    build: float = 0.0  # the model on the meta device
    attach: float = 0.0  # weights: daemon views, or a disk load
    warmup: float = 0.0  # one forward pass
    total: float = 0.0  # up to ready (HTTP listening, agent told)


class Metrics:
    def __init__(self) -> None:
        self.requests: collections.Counter[str] = collections.Counter()
        self.tokens_total = 0
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self.phases = Phases()
        self.weights_source = ""

    def count(self, code: int) -> None:
        self.requests[str(code)] += 1

    def add_tokens(self, n: int) -> None:
        now = time.monotonic()
        self.tokens_total += n
        self._recent.append((now, n))

    def tokens_per_s(self) -> float:
        cutoff = time.monotonic() - WINDOW_S
        while self._recent and self._recent[0][0] < cutoff:
            self._recent.popleft()
        return sum(n for _, n in self._recent) / WINDOW_S

    def render(self, *, name: str, role: str, epoch: int, in_flight: int, stats: Stats) -> str:
        lines: list[str] = []

        def metric(key: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP holdfast_engine_{key} {help_}")
            lines.append(f"# TYPE holdfast_engine_{key} {kind}")
            lines.extend(f"holdfast_engine_{key}{labels} {value:g}" for labels, value in samples)

        info = f'{{name="{name}",role="{role}",weights="{self.weights_source}"}}'
        metric("info", "gauge", "engine identity", [(info, 1)])
        metric("epoch", "gauge", "epoch this engine serves under", [("", epoch)])
        metric(
            "requests_total",
            "counter",
            "HTTP requests answered, by status code",
            [(f'{{code="{c}"}}', n) for c, n in sorted(self.requests.items())] or [("", 0)],
        )
        metric("in_flight", "gauge", "requests accepted and not finished", [("", in_flight)])
        metric("queued", "gauge", "requests waiting for the model", [("", stats.waiting)])
        metric("running", "gauge", "requests in the running batch", [("", stats.running)])
        metric("waiting", "gauge", "requests waiting for KV cache blocks", [("", stats.waiting)])
        metric(
            "max_batch",
            "gauge",
            "most requests one step runs (1: one at a time)",
            [("", stats.max_batch)],
        )
        metric(
            "kv_blocks",
            "gauge",
            "KV cache blocks, by state",
            [('{state="used"}', stats.kv_blocks_used), ('{state="free"}', stats.kv_blocks_free)],
        )
        metric("step_ms", "gauge", "wall time of the last model step", [("", stats.step_ms)])
        metric("steps_total", "counter", "model steps run", [("", stats.steps)])
        metric("generated_tokens_total", "counter", "tokens generated", [("", self.tokens_total)])
        metric(
            "tokens_per_second",
            "gauge",
            f"tokens generated over the last {WINDOW_S:g} s",
            [("", self.tokens_per_s())],
        )
        metric(
            "attach_ms", "gauge", "time to attach (or load) the weights", [("", self.phases.attach)]
        )
        metric("startup_ms", "gauge", "engine start to ready", [("", self.phases.total)])
        metric(
            "startup_phase_ms",
            "gauge",
            "startup time by phase",
            [
                (f'{{phase="{k}"}}', v)
                for k, v in msgspec.structs.asdict(self.phases).items()
                if k != "total"
            ],
        )
        return "\n".join(lines) + "\n"
