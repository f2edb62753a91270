"""A vLLM engine's load for the batch rules, from the text of its `/metrics`."""

from __future__ import annotations

import msgspec

from supervisor.kinds.vllm_spec import VllmSpec

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"


class Sample(msgspec.Struct, frozen=True):
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0  # 0..1


def parse_metrics(text: str) -> Sample:
    """The three figures the load rule reads, summed over their label sets."""
    sums = {RUNNING: 0.0, WAITING: 0.0, KV_USAGE: 0.0}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in sums:
            try:
                sums[name] += float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
    return Sample(sums[RUNNING], sums[WAITING], sums[KV_USAGE])


def load_of(s: Sample, v: VllmSpec, evict_above: int) -> tuple[int, int]:
    """(in flight, queued) as the load rule counts them: running plus waiting requests,
    and over `evict_above` while the KV cache is fuller than `kv_evict_above`."""
    in_flight = int(s.running + s.waiting)
    if s.kv_usage >= v.kv_evict_above:
        in_flight = max(in_flight, evict_above + 1)
    return in_flight, int(s.waiting)
