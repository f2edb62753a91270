"""The supervisor's GET /metrics (on the health API), through prometheus_client.

Two sorts of figures, one collector on the supervisor's own `CollectorRegistry`:

- Counted from the event bus (`EventBus.subscribe`): promotions, fences by cause,
  restarts, quarantines, evictions, and the time each unit spends in each state. The
  Crew code knows nothing of metrics; every state change is already an event.
- Read at scrape time from the parts that count for themselves: the router (forwarded,
  retried, failed, broken), the MQTT publisher (queue depth, dropped), the agent and control
  sockets (malformed frames), the bus (events emitted).

docs/metrics.md lists every metric with its type and labels.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator, Iterator
from typing import Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from holdfast_contract.events import Event
from holdfast_contract.events import EventName as N
from supervisor.aio import cancel_all
from supervisor.events import EventBus
from supervisor.histogram import Histogram
from supervisor.proxy.routing import Tally
from supervisor.proxy.warming import Warmer
from supervisor.states import DaemonState

PREFIX = "holdfast_supervisor_"
UNITS = ("daemon", "engine")  # the events' `kind`s that restart and are quarantined
# a daemon's event named for the state it enters (all but `stopped`, as the supervisor ends)
DAEMON_STATES = frozenset(DaemonState) - {DaemonState.STOPPED}
# upper bounds (s) of the state-duration histogram's buckets
BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0)
UPDATE_OUTCOMES = (N.SWITCHED, N.ROLLED_BACK, N.FINISHED)  # update.main.<event>s counted
QUEUE = 100_000  # events the metrics task may fall behind by before it misses some


class Counts(Protocol):
    malformed: int


class RouterCounts(Protocol):
    tally: Tally  # forwarded, retried, failed, broken, migrations, stalls
    warmer: Warmer


class SupervisorMetrics:
    """Subscribes to `bus` at once; `follow()` (run by the health API) counts its events."""

    CONTENT_TYPE = CONTENT_TYPE_LATEST

    def __init__(
        self,
        bus: EventBus,
        *,
        router: RouterCounts | None = None,
        agents: Counts | None = None,
        control: Counts | None = None,
    ) -> None:
        self.bus, self.router, self.agents, self.control = bus, router, agents, control
        self._events = bus.subscribe(QUEUE)
        self.promotions: collections.Counter[str] = collections.Counter()  # by cause
        self.fences: collections.Counter[tuple[str, str]] = collections.Counter()
        # by unit (daemon, engine); both from zero, so a first restart is an increase, not a new series
        self.restarts = collections.Counter(dict.fromkeys(UNITS, 0))
        self.quarantines = collections.Counter(dict.fromkeys(UNITS, 0))
        self.evictions: collections.Counter[str] = collections.Counter()  # by reason
        # rolling updates, by what became of them (supervisor/update/)
        self.updates: collections.Counter[str] = collections.Counter(
            {str(o): 0 for o in UPDATE_OUTCOMES}
        )
        self._started: set[tuple[str, str]] = set()  # units seen starting once
        self._state: dict[tuple[str, str], tuple[str, float]] = {}  # unit -> (state, since)
        self._seconds: dict[tuple[str, str, str], float] = collections.defaultdict(float)
        self._stays: dict[tuple[str, str], Histogram] = collections.defaultdict(
            lambda: Histogram(BUCKETS)
        )
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    # ---- counting events ----
    async def follow(self) -> None:
        """Count every event the bus emits, until cancelled."""
        while True:
            self.count(await self._events.get())

    async def running(self, _: object) -> AsyncIterator[None]:
        """An aiohttp cleanup context: `follow()` while the app runs."""
        task = asyncio.get_running_loop().create_task(self.follow(), name="metrics")
        try:
            yield
        finally:
            await cancel_all([task])

    def count(self, ev: Event) -> None:
        unit = (ev.kind, ev.name)
        if ev.event == N.PROMOTED:
            self.promotions[str(ev.data.get("cause", ""))] += 1
        elif ev.event == N.FENCED or (ev.kind == "daemon" and ev.event == N.HUNG):
            self.fences[(ev.kind, str(ev.data.get("cause", "hang")))] += 1
        elif ev.event == N.QUARANTINED:
            self.quarantines[ev.kind] += 1
        elif ev.event == N.EVICTED:
            self.evictions[_reason(ev.data.get("reason"))] += 1
        elif ev.kind == "update" and ev.event in UPDATE_OUTCOMES:
            self.updates[ev.event] += 1
        elif ev.event == N.STARTING:
            if unit in self._started:
                self.restarts[ev.kind] += 1
            self._started.add(unit)
        state = self._state_of(ev)
        if state is not None:
            self._enter(unit, state, ev.ts)

    @staticmethod
    def _state_of(ev: Event) -> str | None:
        if ev.kind == "engine":
            state = ev.data.get("state")
            return state if isinstance(state, str) else None
        if ev.kind == "daemon" and ev.event in DAEMON_STATES:
            return ev.event
        return None

    def _enter(self, unit: tuple[str, str], state: str, ts: float) -> None:
        was = self._state.get(unit)
        if was is not None and was[0] == state:
            return
        if was is not None:
            spent = max(0.0, ts - was[1])
            self._seconds[(*unit, was[0])] += spent
            self._stays[(unit[0], was[0])].observe(spent)
        self._state[unit] = (state, ts)

    # ---- exposition ----
    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    async def handle(self, _: web.Request) -> web.Response:
        """GET /metrics."""
        return web.Response(body=self.exposition(), headers={"Content-Type": self.CONTENT_TYPE})

    def collect(self) -> Iterator[Metric]:  # prometheus_client's Collector protocol
        yield from self._event_counts()
        yield from self._states()
        yield from self._sources()

    def _event_counts(self) -> Iterator[Metric]:
        yield _counter(
            "promotions", "standbys promoted to primary, by cause", self.promotions, "cause"
        )
        fences = CounterMetricFamily(
            PREFIX + "fences",
            "units fenced (process group killed), by cause",
            labels=["kind", "cause"],
        )
        for (unit, cause), n in sorted(self.fences.items()):
            fences.add_metric([unit, cause], n)
        yield fences
        yield _counter(
            "restarts", "units started again after their first start", self.restarts, "kind"
        )
        yield _counter(
            "quarantines",
            "units quarantined (restart intensity exceeded)",
            self.quarantines,
            "kind",
        )
        yield _counter("evictions", "batch engines evicted, by reason", self.evictions, "reason")
        yield _counter("updates", "rolling model updates, by outcome", self.updates, "outcome")

    def _states(self) -> Iterator[Metric]:
        now = time.time()
        seconds = CounterMetricFamily(
            PREFIX + "state_seconds",
            "time units spent in each state, the current stay included",
            labels=["kind", "name", "state"],
        )
        totals = collections.defaultdict(float, self._seconds)
        units = GaugeMetricFamily(
            PREFIX + "units", "units in each state now", labels=["kind", "state"]
        )
        now_in: collections.Counter[tuple[str, str]] = collections.Counter()
        for (unit, name), (state, since) in self._state.items():
            totals[(unit, name, state)] += max(0.0, now - since)
            now_in[(unit, state)] += 1
        for key, s in sorted(totals.items()):
            seconds.add_metric(list(key), s)
        for (unit, state), n in sorted(now_in.items()):
            units.add_metric([unit, state], n)
        yield seconds
        yield units
        stays = HistogramMetricFamily(
            PREFIX + "state_duration_seconds",
            "completed stays in a state, by unit kind and state",
            labels=["kind", "state"],
        )
        for (unit, state), d in sorted(self._stays.items()):
            stays.add_metric([unit, state], d.cumulative(), d.total)
        yield stays

    def _sources(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            PREFIX + "events", "events emitted on the bus", value=self.bus.count
        )
        mqtt = self.bus.mqtt
        if mqtt is not None:
            yield _gauge("mqtt_queue_depth", "MQTT messages waiting to be published", mqtt.queued)
            yield CounterMetricFamily(
                PREFIX + "mqtt_dropped",
                "MQTT messages dropped from a full queue",
                value=mqtt.dropped,
            )
            yield CounterMetricFamily(
                PREFIX + "mqtt_published", "MQTT messages published", value=mqtt.published
            )
            yield _gauge("mqtt_connected", "1 while connected to the broker", int(mqtt.connected))
        malformed = CounterMetricFamily(
            PREFIX + "malformed_frames",
            "frames refused as malformed, by socket",
            labels=["socket"],
        )
        for socket, src in (("agents", self.agents), ("control", self.control)):
            if src is not None:
                malformed.add_metric([socket], src.malformed)
        yield malformed
        if self.router is not None:
            yield from self._router(self.router.tally, self.router.warmer)

    def _router(self, r: Tally, warmer: Warmer) -> Iterator[Metric]:
        for key, n, help_ in (
            ("router_forwarded", r.forwarded, "requests answered by a primary"),
            ("router_retries", r.retried, "requests retried on the next primary"),
            ("router_failures", r.failed, "requests answered 502: no primary could answer"),
            ("router_broken_streams", r.broken, "responses cut off after their first byte"),
        ):
            yield CounterMetricFamily(PREFIX + key, help_, value=n)
        migrations = CounterMetricFamily(
            PREFIX + "router_migrations",
            "cut streams continued on the next primary, by outcome",
            labels=["outcome"],
        )
        for outcome, n in r.migrations.items():
            migrations.add_metric([outcome], n)
        yield migrations
        warms = CounterMetricFamily(
            PREFIX + "router_warm_requests",
            "streams' pasts sent to the next standby to keep warm, by outcome",
            labels=["outcome"],
        )
        warms.add_metric(["kept"], warmer.sent)
        warms.add_metric(["failed"], warmer.failed)
        yield warms
        stalls = HistogramMetricFamily(
            PREFIX + "router_stream_stall_seconds",
            "a migrated stream's last token before the cut to its first after it, by how "
            "its continuation began: from the dead primary's KV cache (adopted), from a "
            "past kept warm (kept), or from the tokens sent, computed again (replayed)",
            labels=["continued"],
        )
        for how, hist in r.stalls.items():
            stalls.add_metric([how], hist.cumulative(), hist.total)
        yield stalls


def _reason(reason: object) -> str:
    """An eviction reason as a label: its first word (`load 5 > 3` is `load`)."""
    words = str(reason or "").split()
    return words[0] if words else "unknown"


def _counter(key: str, help_: str, counts: collections.Counter[str], label: str) -> Metric:
    family = CounterMetricFamily(PREFIX + key, help_, labels=[label])
    for value, n in sorted(counts.items()):
        family.add_metric([value], n)
    return family


def _gauge(key: str, help_: str, value: float) -> Metric:
    return GaugeMetricFamily(PREFIX + key, help_, value=value)
