"""What the engine exposes at GET /metrics, through prometheus_client.

Each engine has its own `CollectorRegistry` (never the process-global one) holding one
collector, which reads the engine's live figures when scraped: counts kept here (requests by
status code, generated tokens), startup phases, and what `bind` hands it (name, role, epoch,
in-flight requests and the model thread's `Stats`). docs/metrics.md lists every metric.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterator

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from engine.job import Stats

WINDOW_S = 10.0
PREFIX = "holdfast_engine_"


class Phases(msgspec.Struct):
    """Where startup went, in ms from the engine's first line of Python."""

    imports: float = 0.0
    context_init: float = 0.0  # torch.distributed / CUDA context
    build: float = 0.0  # the model on the meta device
    attach: float = 0.0  # weights: daemon views, or a disk load
    warmup: float = 0.0  # one forward pass
    tokenizer: float = 0.0  # its files read (0: read before the fork, by the fork server)
    total: float = 0.0  # up to ready (HTTP listening, agent told)
    spare: float = 0.0  # a spare's warm-up, done before the request (0: a fresh process)


class Live(msgspec.Struct, frozen=True):
    """The engine's figures at the moment of a scrape."""

    name: str
    role: str
    epoch: int
    in_flight: int
    stats: Stats


class Metrics:
    CONTENT_TYPE = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.requests: collections.Counter[str] = collections.Counter()
        self.tokens_total = 0
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self.phases = Phases()
        self.weights_source = ""
        self._live: Callable[[], Live] | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def bind(self, live: Callable[[], Live]) -> None:
        """Where a scrape reads the engine's name, role, epoch, load and model stats."""
        self._live = live

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

    def exposition(self) -> bytes:
        """The registry in the Prometheus text format (`CONTENT_TYPE`)."""
        return generate_latest(self.registry)

    # ---- prometheus_client's Collector protocol ----
    def collect(self) -> Iterator[Metric]:
        yield from self._counts()
        if self._live is not None:
            yield from self._engine(self._live())
        yield from self._startup()

    def _counts(self) -> Iterator[Metric]:
        req = CounterMetricFamily(
            PREFIX + "requests", "HTTP requests answered, by status code", labels=["code"]
        )
        for code, n in sorted(self.requests.items()):
            req.add_metric([code], n)
        yield req
        yield CounterMetricFamily(
            PREFIX + "generated_tokens", "tokens generated", value=self.tokens_total
        )
        yield _gauge(
            "tokens_per_second",
            f"tokens generated over the last {WINDOW_S:g} s",
            self.tokens_per_s(),
        )

    def _engine(self, live: Live) -> Iterator[Metric]:
        info = GaugeMetricFamily(
            PREFIX + "info", "engine identity", labels=["name", "role", "weights"]
        )
        info.add_metric([live.name, live.role, self.weights_source], 1)
        yield info
        st = live.stats
        yield _gauge("epoch", "epoch this engine serves under", live.epoch)
        yield _gauge("in_flight", "requests accepted and not finished", live.in_flight)
        yield _gauge("queued", "requests waiting for the model", st.waiting)
        yield _gauge("running", "requests in the running batch", st.running)
        yield _gauge("waiting", "requests waiting for KV cache blocks", st.waiting)
        yield _gauge("max_batch", "most requests one step runs (1: one at a time)", st.max_batch)
        blocks = GaugeMetricFamily(
            PREFIX + "kv_blocks", "KV cache blocks, by state", labels=["state"]
        )
        blocks.add_metric(["used"], st.kv_blocks_used - st.kv_blocks_kept)
        blocks.add_metric(["kept"], st.kv_blocks_kept)
        blocks.add_metric(["free"], st.kv_blocks_free)
        yield blocks
        yield _gauge(
            "kept_prefixes", "streams' pasts kept warm for a continuation", st.kept_prefixes
        )
        yield CounterMetricFamily(
            PREFIX + "reused_prompt_tokens",
            "prompt tokens not computed again: a kept prefix held their keys and values",
            value=st.reused_tokens,
        )
        yield _gauge("step_ms", "wall time of the last model step", st.step_ms)
        yield CounterMetricFamily(PREFIX + "steps", "model steps run", value=st.steps)

    def _startup(self) -> Iterator[Metric]:
        yield _gauge("attach_ms", "time to attach (or load) the weights", self.phases.attach)
        yield _gauge("startup_ms", "engine start to ready", self.phases.total)
        yield _gauge(
            "spare_warmup_ms",
            "warm-up done by a spare process before this engine's request (0: none)",
            self.phases.spare,
        )
        phases = GaugeMetricFamily(
            PREFIX + "startup_phase_ms", "startup time by phase", labels=["phase"]
        )
        for k, v in msgspec.structs.asdict(self.phases).items():
            if k not in ("total", "spare"):
                phases.add_metric([k], v)
        yield phases


def _gauge(key: str, help_: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + key, help_, value=value)
