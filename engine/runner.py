"""The model runner: one scheduler step for a whole batch, in lockstep across TP ranks.

Rank 0 turns a `Plan` into step inputs (token ids, positions, cache slots, block tables),
broadcasts them to the other tensor-parallel ranks, runs the model and samples greedily;
the other ranks sit in `follow()` and run exactly the steps rank 0 broadcasts. Requests
themselves (cancellation, EOS, max_tokens) live only on rank 0: a request that ends is
simply not in the next step, so every rank stops it at the same step.

Decode steps on one CUDA device replay CUDA graphs captured at a set of batch sizes
(`engine.graphs`), and so do steps whose only other rows are continued prompts' fresh
tokens; everything else runs eagerly, with the same code.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import structlog
import torch
import torch.distributed as dist
from torch import nn

from engine import sampling
from engine.attention import Batch, use_kernel
from engine.errors import BadRequest
from engine.graphs import DecodeGraphs
from engine.job import TOP_LOGPROBS_MAX, Generation, Job, OnStep, Step
from engine.kvcache import KVCache, blocks_for
from engine.model import LlamaForCausalLM
from engine.scheduler import Plan, Seq

# The prompt lengths of the warm-up's prefill steps (cut to the engine's max_len and
# max_batch): Triton specializes an integer argument on being 1 and on being a multiple of
# 16, and a step of several prompts pads them to the longest; the last step's requests
# then decode, and decode beside a prefill.
WARM_PREFILLS: tuple[tuple[int, ...], ...] = ((1,), (17,), (32,), (33, 16))
# On CUDA also what a migration brings a just-promoted standby at once: many continuations
# of a few hundred tokens, up to a full prefill step (bench/results/first-step/NOTES.md).
# On the CPU these would cost seconds of every start.
WARM_PREFILLS_CUDA = (*WARM_PREFILLS, (255,) * 4, (511,) * 16)

__all__ = ["TOP_LOGPROBS_MAX", "Generation", "Job", "OnStep", "Runner", "Step"]

log = structlog.get_logger("engine.runner")
ALIGN = 2  # int64s in 16 bytes: every part of a step's copy starts at a multiple
OP_STEP, OP_STOP = 1, 2


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
        self.max_batch, self.max_len = max_batch, max_len
        self.tp = model.tp
        self.eos = frozenset(model.args.eos_token_ids)
        self.kernel = use_kernel(device)
        if self.kernel:  # rope_store looks up each token's rotation: no per-step cos/sin
            model.rotations(max_len)
        self.width = -(-max_len // cache.block_size)  # block-table columns of the longest
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs and device.type == "cuda" and self.tp.size == 1 and self.kernel:
            self.graphs = DecodeGraphs(
                self._decode_and_sample, device, cache, max_batch, self.width
            )

    def embed(self, batch: list[list[int]]) -> list[list[float]]:
        raise BadRequest("this model serves /v1/completions only")

    # ---- rank 0 ----
    def step(self, plan: Plan, launched: Callable[[], None] | None = None) -> list[Step]:
        """Run one step of `plan` on every rank; the sampled token of each request.
        `launched` runs once the step is queued on the device, before waiting for it,
        when queuing it is quick: a graph replay's launch. Otherwise it runs before the
        step: on the CPU, which computes as it is called, and for an eager CUDA step,
        whose launches alone take tens of ms on a large model (so the last step's tokens
        are not held back for this one's)."""
        ids, batch = self._inputs(plan)
        if launched is not None and not self._replays(ids, batch):
            launched()
            launched = None
        try:
            if self.tp.size > 1:
                self._send(plan, ids, batch)
            packed = self._run(ids, batch)
        except RuntimeError as e:  # a rank is gone: this group can never compute again
            if self.tp.size == 1:
                raise
            log.critical("tensor-parallel group broken; exiting", error=str(e))
            os._exit(3)
        if launched is not None:
            launched()
        if self.device.type == "cuda":  # wait with the GIL released: heartbeats go on
            torch.cuda.current_stream(self.device).synchronize()
        rows = packed.tolist()
        return [unpack(row, seq.top_logprobs) for row, seq in zip(rows, plan.seqs, strict=True)]

    def warmup(self, prompts: tuple[tuple[int, ...], ...] | None = None) -> None:
        """Prefills of `prompts` (each a step of prompts of these lengths; by default
        WARM_PREFILLS, on CUDA WARM_PREFILLS_CUDA), a decode of
        the last step's requests and a step mixing a prefill with their decode, on every
        rank (no broadcast: all call it). On CUDA this compiles the Triton kernels (or
        loads them from Triton's disk cache) for each way a step's sizes specialize them,
        before ready, while the supervisor allows a starting engine to be silent: a
        compile holds the GIL, and so the heartbeat thread, for a second or more. A warm
        standby's first real step (a migrated stream's continuation, just promoted) then
        compiles nothing. Every position goes to the scratch block: no request's keys are
        touched."""
        with self._layers_of_each_kind():
            self._warm_steps(prompts)

    def _warm_steps(self, prompts: tuple[tuple[int, ...], ...] | None) -> None:
        if prompts is None:
            prompts = WARM_PREFILLS_CUDA if self.device.type == "cuda" else WARM_PREFILLS
        seqs: tuple[Seq, ...] = ()
        for lengths in prompts:
            cut = lengths[: self.max_batch]
            seqs = tuple(self._scratch_seq(n) for n in cut)
            rows = self._decode_and_sample(*self._inputs(Plan(prefill=seqs))).tolist()
            for seq, row in zip(seqs, rows, strict=True):
                seq.out.append(unpack(row, 0))
        if seqs:
            self._decode_and_sample(*self._inputs(Plan(decode=seqs)))
            beside = self._scratch_seq(prompts[-1][0])
            mixed = Plan(prefill=(beside,), decode=seqs[: self.max_batch - 1])
            self._decode_and_sample(*self._inputs(mixed))

    @contextlib.contextmanager
    def _layers_of_each_kind(self) -> Iterator[None]:
        """On CUDA the warm-up's steps run through the first decoder layer of each kind
        (its class and its tensors' names, shapes and dtypes) alone: every kernel a step
        launches, and every specialization Triton compiles, is the same in each layer of
        a kind, and the other layers' compute (31 of llama-8b's 32) was most of a start's
        warm-up. On the CPU every layer runs: it touches the pool's pages, which a first
        request would otherwise fault in."""
        decoder = self.model.model
        layers = decoder.layers
        if self.device.type != "cuda":
            yield
            return
        decoder.layers = one_of_each_kind(layers)
        try:
            yield
        finally:
            decoder.layers = layers

    def _scratch_seq(self, n: int) -> Seq:
        """A request of `n` prompt tokens (at most what max_len leaves room for) whose
        positions all go to the scratch block."""
        n = max(1, min(n, self.max_len - 2))
        seq = Seq((0,) * n, 2, ignore_eos=True)
        seq.blocks = [self.cache.blocks] * blocks_for(n + 1, self.cache.block_size)
        return seq

    def capture_next(self) -> bool:
        """Capture one more decode graph, if any is left; True if one was captured."""
        return self.graphs is not None and self.graphs.capture_next()

    def stop_followers(self) -> None:
        if self.tp.size > 1:
            self._bcast_header(OP_STOP, 0, 0, 0, 0)

    # ---- ranks > 0 ----
    def follow(self) -> int:
        """Run rank 0's steps until it says stop (0) or is gone (3): the exit status."""
        try:
            while True:
                op, tokens, prompts, decodes, width = self._bcast_header(0, 0, 0, 0, 0)
                if op == OP_STOP:
                    return 0
                self._run(*self._receive(tokens, prompts, decodes, width))
        except RuntimeError as e:
            log.critical("rank 0 is gone; exiting", error=str(e))
            return 3

    # ---- all ranks ----
    @torch.inference_mode()
    def _run(self, ids: torch.Tensor, batch: Batch) -> torch.Tensor:
        if self.graphs is None or not self._replays(ids, batch):
            return self._decode_and_sample(ids, batch)
        out = self.graphs.replay(ids, batch)
        assert out is not None  # a captured size fits: `_replays`
        if batch.last.shape[0] == ids.shape[0]:
            return out
        # Kept prefixes continue in this step: their fresh tokens are decode rows (one
        # each, `_inputs`), so a graph of that many rows computes them; each request's
        # token is its last row's.
        self.graphs.continued += 1
        return out[batch.last]

    def _decode_and_sample(self, ids: torch.Tensor, batch: Batch) -> torch.Tensor:
        logits = self.model(ids, batch, self.cache)
        if batch.triton:  # two kernels that read the logits once, in the head's dtype
            return sampling.sample_kernel(logits, TOP_LOGPROBS_MAX)
        return sampling.sample(logits, TOP_LOGPROBS_MAX)

    def _inputs(self, plan: Plan, triton: bool | None = None) -> tuple[torch.Tensor, Batch]:
        """A step's tensors. Its token axis: the prompts prefilled whole, then the fresh
        tokens of prompts continuing a kept prefix (`Seq.cached`), then one token per
        running request. A continued prompt's tokens attend like decode queries (each
        to its request's blocks up to itself: its keys are stored first), so they ride
        in the decode part of the step, one row each. So do whole prompts when the step's
        tokens fit a captured graph (`_rows_fit`)."""
        bs = self.cache.block_size
        whole = [s for s in plan.prefill if not s.cached]
        if whole and self._rows_fit(plan):  # then a captured graph runs the whole step
            whole = []
        rows = [
            (s, p) for s in plan.prefill if s not in whole for p in range(s.cached, len(s.prompt))
        ]
        rows += [(s, s.position) for s in plan.decode]
        ids = [t for s in whole for t in s.prompt]
        ids += [s.prompt[p] if p < len(s.prompt) else s.last_token for s, p in rows]
        pos = [p for s in whole for p in range(len(s.prompt))] + [p for _, p in rows]
        seqs = [s for s in whole for _ in s.prompt] + [s for s, _ in rows]
        slots = [s.blocks[p // bs] * bs + p % bs for s, p in zip(seqs, pos, strict=True)]
        bounds = [0]
        for s in whole:
            bounds.append(bounds[-1] + len(s.prompt))
        width = max((len(s.blocks) for s, _ in rows), default=0)
        tables = [s.blocks + [0] * (width - len(s.blocks)) for s, _ in rows]
        last: list[int] | None = None
        extend: list[tuple[int, int, int]] = []
        if len(whole) < len(plan.prefill):  # each request's last token, in plan.seqs order
            ends = {s.id: i for i, s in enumerate(seqs)}  # (the last index of each wins)
            last = [ends[s.id] for s in plan.seqs]
            for s in plan.prefill:
                if s.cached:
                    first = extend[-1][1] if extend else 0
                    extend.append((first, first + s.fresh, len(s.prompt)))
        return self._batch(ids, pos, slots, bounds, tables, triton, last, tuple(extend))

    @property
    def graph_rows(self) -> int:
        """Rows of the largest captured graph (0 while there is none): the most tokens a
        step can hold and still be one replay."""
        return max(self.graphs.graphs, default=0) if self.graphs is not None else 0

    def _rows_fit(self, plan: Plan) -> bool:
        """Whether every token of `plan` fits one captured graph as rows: then prompts
        prefill as rows too (one query each against the request's blocks, as a continued
        prompt's fresh tokens do), and a small prefill (one stream's prompt, a warm past)
        is a replay, not an eager pass."""
        tokens = sum(s.fresh for s in plan.prefill) + len(plan.decode)
        return 0 < tokens <= self.graph_rows

    def _replays(self, ids: torch.Tensor, batch: Batch) -> bool:
        """Whether a step of these inputs replays a captured graph (`_run`)."""
        return batch.prefill_tokens == 0 and 0 < ids.shape[0] <= self.graph_rows

    def _batch(
        self,
        ids: list[int],
        pos: list[int],
        slots: list[int],
        bounds: list[int],
        tables: list[list[int]],
        triton: bool | None = None,
        last: list[int] | None = None,
        extend: tuple[tuple[int, int, int], ...] = (),
    ) -> tuple[torch.Tensor, Batch]:
        """The step's tensors, sent to the device in one copy (int64 throughout). Each starts
        16 bytes aligned in that copy: Triton specializes a kernel on whether each pointer
        is, so a part at an odd offset would compile its kernels once more, mid-serving
        (bench/results/first-step/NOTES.md)."""
        split, n = bounds[-1], len(ids)
        if last is None:
            last = [b - 1 for b in bounds[1:]] + list(range(split, n))
        lengths = [p + 1 for p in pos[split:]]
        parts_in = (ids, pos, slots, last, lengths, [t for r in tables for t in r])
        sizes = [len(part) for part in parts_in]
        padded = [-(-size // ALIGN) * ALIGN for size in sizes]
        values: list[int] = []
        for part, size, room in zip(parts_in, sizes, padded, strict=True):
            values += part
            values += [0] * (room - size)
        flat = torch.tensor(values, dtype=torch.int64)
        if self.device.type == "cuda":
            flat = flat.pin_memory()
        flat = flat.to(self.device, non_blocking=True)
        chunks = torch.split(flat, padded)
        parts = [c[:size] for c, size in zip(chunks, sizes, strict=True)]
        batch = Batch(
            parts[1],
            parts[2],
            parts[3],
            bounds=tuple(bounds),
            tables=parts[5].view(len(tables), -1) if tables else None,
            lengths=parts[4] if tables else None,
            triton=self.kernel if triton is None else triton,
            extend=extend,
        )
        return parts[0], batch

    # ---- the broadcast of a step's composition (tp > 1) ----
    def _send(self, plan: Plan, ids: torch.Tensor, batch: Batch) -> None:
        width = batch.tables.shape[1] if batch.tables is not None else 0
        self._bcast_header(OP_STEP, ids.shape[0], len(plan.prefill), len(plan.decode), width)
        parts = [ids, batch.positions, batch.slots]
        parts.append(torch.tensor(batch.bounds, dtype=torch.int64, device=self.device))
        if batch.tables is not None:
            parts.append(batch.tables.flatten())
        dist.broadcast(torch.cat(parts), src=0)

    def _receive(
        self, tokens: int, prompts: int, decodes: int, width: int
    ) -> tuple[torch.Tensor, Batch]:
        flat = torch.empty(3 * tokens + prompts + 1 + decodes * width, dtype=torch.int64)
        flat = flat.to(self.device)
        dist.broadcast(flat, src=0)
        v = flat.tolist()
        ids, pos, slots = v[:tokens], v[tokens : 2 * tokens], v[2 * tokens : 3 * tokens]
        bounds = v[3 * tokens : 3 * tokens + prompts + 1]
        rest = v[3 * tokens + prompts + 1 :]
        tables = [rest[i * width : (i + 1) * width] for i in range(decodes)]
        return self._batch(ids, pos, slots, bounds, tables)

    def _bcast_header(self, *values: int) -> list[int]:
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.broadcast(t, src=0)
        return [int(v) for v in t.tolist()]


def one_of_each_kind(layers: nn.ModuleList) -> nn.ModuleList:
    """The first of `layers` of each kind: its class and its tensors' names, shapes and
    dtypes, in their order."""
    kinds: dict[tuple[object, ...], nn.Module] = {}
    for layer in layers:
        tensors = (*layer.named_parameters(), *layer.named_buffers())
        kind = (type(layer), *((n, tuple(t.shape), t.dtype) for n, t in tensors))
        kinds.setdefault(kind, layer)
    return nn.ModuleList(kinds.values())
