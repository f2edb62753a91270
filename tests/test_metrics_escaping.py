"""Label values that need escaping in the Prometheus text format come back intact."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from engine.job import Stats
from engine.metrics import Live, Metrics

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
