"""The model runner: one scheduler step for a whole batch, in lockstep across TP ranks.

Rank 0 turns a `Plan` into step inputs (token ids, positions, cache slots, block tables),
broadcasts them to the other tensor-parallel ranks, runs the model and samples greedily;
the other ranks sit in `follow()` and run exactly the steps rank 0 broadcasts. Requests
themselves (cancellation, EOS, max_tokens) live only on rank 0: a request that ends is
simply not in the next step, so every rank stops it at the same step.

Decode steps on one CUDA device replay CUDA graphs captured at a set of batch sizes
(`engine.graphs`); everything else runs eagerly, with the same code.
"""

from __future__ import annotations

import os

import structlog
import torch
import torch.distributed as dist

from engine.attention import Batch, use_kernel
from engine.errors import BadRequest
from engine.graphs import DecodeGraphs
from engine.job import TOP_LOGPROBS_MAX, Generation, Job, OnStep, Step
from engine.kvcache import KVCache
from engine.model import LlamaForCausalLM
from engine.scheduler import Plan, Seq

__all__ = ["TOP_LOGPROBS_MAX", "Generation", "Job", "OnStep", "Runner", "Step"]

log = structlog.get_logger("engine.runner")
OP_PREFILL, OP_DECODE, OP_STOP = 1, 2, 3


def sample(logits: torch.Tensor) -> torch.Tensor:
    """(n, vocab) -> (n, 2 + 2K) float32: greedy id, its logprob, top-K ids, top-K logprobs.
    One tensor, so reading the step's result is one device-to-host copy."""
    logp = torch.log_softmax(logits, dim=-1)
    ids = torch.argmax(logits, dim=-1, keepdim=True)
    vals, top = torch.topk(logp, min(TOP_LOGPROBS_MAX, logp.shape[-1]), dim=-1)
    return torch.cat([ids.float(), logp.gather(-1, ids), top.float(), vals], dim=-1)


def unpack(row: list[float], top_k: int) -> Step:
    k = (len(row) - 2) // 2
    top = tuple((int(row[2 + i]), row[2 + k + i]) for i in range(top_k))
    return Step(int(row[0]), row[1], top)


class Runner:
    kind = "generate"

    def __init__(
        self,
        model: LlamaForCausalLM,
        device: torch.device,
        cache: KVCache,
        *,
        max_batch: int,
        max_len: int,
        cuda_graphs: bool,
    ) -> None:
        self.model, self.device, self.cache = model, device, cache
        self.tp = model.tp
        self.eos = frozenset(model.args.eos_token_ids)
        self.kernel = use_kernel(device)
        self.width = -(-max_len // cache.block_size)  # block-table columns of the longest
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs and device.type == "cuda" and self.tp.size == 1 and self.kernel:
            self.graphs = DecodeGraphs(
                self._decode_and_sample, device, cache, max_batch, self.width
            )

    def embed(self, batch: list[list[int]]) -> list[list[float]]:
        raise BadRequest("this model serves /v1/completions only")

    # ---- rank 0 ----
    def step(self, plan: Plan) -> list[Step]:
        """Run one step of `plan` on every rank; the sampled token of each request."""
        ids, batch = self._inputs(plan)
        try:
            if self.tp.size > 1:
                self._send(plan.prefill, ids, batch)
            packed = self._run(ids, batch)
        except RuntimeError as e:  # a rank is gone: this group can never compute again
            if self.tp.size == 1:
                raise
            log.critical("tensor-parallel group broken; exiting", error=str(e))
            os._exit(3)
        rows = packed.tolist()
        return [unpack(row, seq.top_logprobs) for row, seq in zip(rows, plan.seqs, strict=True)]

    def warmup(self) -> None:
        """A prefill and a decode of one request on every rank (no broadcast: all call it)."""
        seq = Seq((0,), 2, ignore_eos=True)
        seq.blocks = [self.cache.blocks]  # the scratch block: no request's keys are touched
        first = Plan(True, (seq,))
        seq.out.append(unpack(self._run(*self._inputs(first)).tolist()[0], 0))
        self._run(*self._inputs(Plan(False, (seq,))))

    def capture_next(self) -> bool:
        """Capture one more decode graph, if any is left; True if one was captured."""
        return self.graphs is not None and self.graphs.capture_next()

    def stop_followers(self) -> None:
        if self.tp.size > 1:
            self._bcast_header(OP_STOP, 0, 0, 0)

    # ---- ranks > 0 ----
    def follow(self) -> int:
        """Run rank 0's steps until it says stop (0) or is gone (3): the exit status."""
        try:
            while True:
                op, tokens, seqs, width = self._bcast_header(0, 0, 0, 0)
                if op == OP_STOP:
                    return 0
                ids, batch = self._receive(op == OP_PREFILL, tokens, seqs, width)
                self._run(ids, batch)
        except RuntimeError as e:
            log.critical("rank 0 is gone; exiting", error=str(e))
            return 3

    # ---- all ranks ----
    @torch.inference_mode()
    def _run(self, ids: torch.Tensor, batch: Batch) -> torch.Tensor:
        if not batch.prefill and self.graphs is not None:
            out = self.graphs.replay(ids, batch)
            if out is not None:
                return out
        return self._decode_and_sample(ids, batch)

    def _decode_and_sample(self, ids: torch.Tensor, batch: Batch) -> torch.Tensor:
        return sample(self.model(ids, batch, self.cache))

    def _inputs(self, plan: Plan) -> tuple[torch.Tensor, Batch]:
        bs = self.cache.block_size
        if plan.prefill:
            ids = [t for s in plan.seqs for t in s.prompt]
            pos = [p for s in plan.seqs for p in range(len(s.prompt))]
            slots = [
                s.blocks[p // bs] * bs + p % bs for s in plan.seqs for p in range(len(s.prompt))
            ]
            bounds = [0]
            for s in plan.seqs:
                bounds.append(bounds[-1] + len(s.prompt))
            return self._prefill_batch(ids, pos, slots, bounds)
        ids = [s.last_token for s in plan.seqs]
        pos = [s.position for s in plan.seqs]
        slots = [s.blocks[p // bs] * bs + p % bs for s, p in zip(plan.seqs, pos, strict=True)]
        width = max(len(s.blocks) for s in plan.seqs)
        tables = [s.blocks + [0] * (width - len(s.blocks)) for s in plan.seqs]
        return self._decode_batch(ids, pos, slots, tables)

    def _tensor(self, values: list[int] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def _prefill_batch(
        self, ids: list[int], pos: list[int], slots: list[int], bounds: list[int]
    ) -> tuple[torch.Tensor, Batch]:
        last = [b - 1 for b in bounds[1:]]
        batch = Batch(
            True,
            self._tensor(pos, torch.int64),
            self._tensor(slots, torch.int64),
            self._tensor(last, torch.int64),
            bounds=tuple(bounds),
        )
        return self._tensor(ids, torch.int64), batch

    def _decode_batch(
        self, ids: list[int], pos: list[int], slots: list[int], tables: list[list[int]]
    ) -> tuple[torch.Tensor, Batch]:
        batch = Batch(
            False,
            self._tensor(pos, torch.int64),
            self._tensor(slots, torch.int64),
            torch.arange(len(ids), device=self.device),
            tables=self._tensor(tables, torch.int32),
            lengths=self._tensor([p + 1 for p in pos], torch.int32),
            kernel=self.kernel,
        )
        return self._tensor(ids, torch.int64), batch

    # ---- the broadcast of a step's composition (tp > 1) ----
    def _send(self, prefill: bool, ids: torch.Tensor, batch: Batch) -> None:
        n = batch.last.shape[0]
        if prefill:
            extra = [torch.tensor(batch.bounds, dtype=torch.int64, device=self.device)]
            width = 0
        else:
            assert batch.tables is not None  # lengths follow from positions
            width = batch.tables.shape[1]
            extra = [batch.tables.long().flatten()]
        self._bcast_header(OP_PREFILL if prefill else OP_DECODE, ids.shape[0], n, width)
        dist.broadcast(torch.cat([ids, batch.positions, batch.slots, *extra]), src=0)

    def _receive(
        self, prefill: bool, tokens: int, seqs: int, width: int
    ) -> tuple[torch.Tensor, Batch]:
        size = 3 * tokens + (seqs + 1 if prefill else seqs * width)
        flat = torch.empty(size, dtype=torch.int64, device=self.device)
        dist.broadcast(flat, src=0)
        ids, pos, slots = flat[:tokens], flat[tokens : 2 * tokens], flat[2 * tokens : 3 * tokens]
        rest = flat[3 * tokens :]
        if prefill:
            return self._prefill_batch(ids.tolist(), pos.tolist(), slots.tolist(), rest.tolist())
        tables = rest.view(seqs, width).tolist()
        return self._decode_batch(ids.tolist(), pos.tolist(), slots.tolist(), tables)

    def _bcast_header(self, op: int, tokens: int, seqs: int, width: int) -> list[int]:
        t = torch.tensor([op, tokens, seqs, width], dtype=torch.int64, device=self.device)
        dist.broadcast(t, src=0)
        return [int(v) for v in t.tolist()]
