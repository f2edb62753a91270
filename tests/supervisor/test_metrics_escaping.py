"""Label values that need escaping in the Prometheus text format come back intact."""

from __future__ import annotations

import asyncio
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from engine.job import Stats
from engine.metrics import Live, Metrics
from supervisor.aio import cancel_all
from supervisor.events import EventBus
from supervisor.metrics import SupervisorMetrics
from supervisor.policy import EventsSpec

AWKWARD = 'a "quoted" name\\with a backslash\nand a newline'


def test_engine_info_labels_with_quotes_backslashes_and_newlines_parse_back() -> None:
    m = Metrics()
    m.weights_source = 'disk "fallback"\\'
    stats = Stats(
        running=1, waiting=2, kv_blocks_used=3, kv_blocks_free=4, max_batch=8, step_ms=1.5, steps=9
    )
    m.bind(lambda: Live(AWKWARD, "primary", 3, 1, stats))
    families = {f.name: f for f in text_string_to_metric_families(m.exposition().decode())}
    [info] = families["holdfast_engine_info"].samples
    assert info.labels == {"name": AWKWARD, "role": "primary", "weights": 'disk "fallback"\\'}
    [steps] = families["holdfast_engine_steps"].samples
    assert (steps.name, steps.value) == ("holdfast_engine_steps_total", 9)
    [running] = families["holdfast_engine_running"].samples
    assert running.value == 1


def test_supervisor_labels_from_events_parse_back(tmp_path: Path) -> None:
    """A fence cause is whatever the event says: escaped, it stays one label value."""

    async def scrape() -> bytes:
        bus = EventBus(f"ipc://{tmp_path}/events", EventsSpec())
        metrics = SupervisorMetrics(bus)
        follow = asyncio.get_running_loop().create_task(metrics.follow())
        try:
            bus.emit("engine", "e1", "starting", 0, state="starting")
            bus.emit("engine", "e1", "fenced", 0, state="primary", cause=AWKWARD)
            for _ in range(1000):  # the follow task runs at the next turn of the loop
                if metrics.fences:
                    break
                await asyncio.sleep(0)
            return metrics.exposition()
        finally:
            await cancel_all([follow])
            await bus.close()

    families = {f.name: f for f in text_string_to_metric_families(asyncio.run(scrape()).decode())}
    [fence] = families["holdfast_supervisor_fences"].samples
    assert fence.labels == {"kind": "engine", "cause": AWKWARD} and fence.value == 1
    states = {s.labels["state"] for s in families["holdfast_supervisor_state_seconds"].samples}
    assert states == {"starting", "primary"}
