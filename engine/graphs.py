"""CUDA graphs for the decode step, captured at a set of batch sizes.

A decode step of a batch of n requests replays the graph of the smallest captured size
>= n, its static inputs filled with the n requests and the rest padded: padded rows write
their keys to the cache's scratch block and attend to one position there. Graphs are
captured after ready, one at a time, by the engine loop between steps (`engine.batcher`):
until a size exists its batches decode eagerly. A ready engine under a supervisor may be
silent only for its heartbeat window, so capture never holds the GIL for long: it uses
the graph's own begin/end rather than `torch.cuda.graph`, which collects Python garbage
(a pause of hundreds of ms with the GIL held, on a heap with torch in it) before every
capture. A batch larger than the largest size runs eagerly.

A row is one query against its request's blocks up to its own position, so the fresh
tokens of a prompt continuing a kept prefix (a migrated stream's, a warm prefill's) are
rows too: a step of such rows, as many as the largest size at most, replays a graph as a
decode step does, and each request takes its last row's token (`Runner._run`). A
failover's first step on the promoted engine is then one replay, not an eager pass.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import structlog
import torch

from engine.attention import Batch
from engine.kvcache import KVCache

log = structlog.get_logger("engine.graphs")
SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
StepFn = Callable[[torch.Tensor, Batch], torch.Tensor]


class DecodeGraphs:
    def __init__(
        self, fn: StepFn, device: torch.device, cache: KVCache, max_batch: int, width: int
    ) -> None:
        self.fn = fn
        self.sizes = [s for s in SIZES if s < max_batch] + [max_batch]
        self.pending = sorted(self.sizes, reverse=True)  # largest first: its pool serves all
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.scratch_block, self.scratch_slot = cache.blocks, cache.scratch_slot
        n = max_batch
        self.ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slots = torch.full((n,), self.scratch_slot, dtype=torch.int64, device=device)
        self.lengths = torch.ones(n, dtype=torch.int64, device=device)
        self.tables = torch.full((n, width), self.scratch_block, dtype=torch.int64, device=device)
        self.last = torch.arange(n, device=device)
        self.capture_ms = 0.0
        self.continued = 0  # steps replayed with rows of continued prompts (engine.runner)
        self.pool: Any = None  # the first graph's memory pool, shared by the others

    def _batch(self, size: int) -> Batch:
        return Batch(
            self.positions[:size],
            self.slots[:size],
            self.last[:size],
            tables=self.tables[:size],
            lengths=self.lengths[:size],
            triton=True,
        )

    @torch.inference_mode()
    def capture_next(self) -> bool:
        if not self.pending:
            return False
        size = self.pending.pop(0)
        t0 = time.perf_counter()
        self._pad(0)
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.fn(self.ids[:size], self._batch(size))  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        side.synchronize()
        with torch.cuda.stream(side):
            graph.capture_begin(pool=self.pool)
            try:
                out = self.fn(self.ids[:size], self._batch(size))
            finally:
                graph.capture_end()
        self.pool = graph.pool()
        self.graphs[size] = (graph, out)
        ms = (time.perf_counter() - t0) * 1e3
        self.capture_ms += ms
        log.info("decode graph captured", batch=size, left=len(self.pending), ms=round(ms, 1))
        if not self.pending:
            log.info("decode graphs ready", sizes=sorted(self.graphs), ms=round(self.capture_ms, 1))
        return True

    def _pad(self, n: int) -> None:
        self.ids[n:].zero_()
        self.positions[n:].zero_()
        self.slots[n:].fill_(self.scratch_slot)
        self.lengths[n:].fill_(1)
        self.tables[n:, :1].fill_(self.scratch_block)

    def replay(self, ids: torch.Tensor, batch: Batch) -> torch.Tensor | None:
        """Run a decode step from its graph, or None if no captured size fits it."""
        n = ids.shape[0]
        size = next((s for s in sorted(self.graphs) if s >= n), None)
        if size is None:
            return None
        assert batch.tables is not None and batch.lengths is not None
        graph, out = self.graphs[size]
        self.ids[:n].copy_(ids)
        self.positions[:n].copy_(batch.positions)
        self.slots[:n].copy_(batch.slots)
        self.lengths[:n].copy_(batch.lengths)
        self.tables[:n, : batch.tables.shape[1]].copy_(batch.tables)
        self._pad(n)
        graph.replay()
        return out[:n]
