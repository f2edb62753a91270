"""Load the step's CUDA kernels while the weights are still being attached.

The first step of a fresh process pays for loading every kernel it launches (cuBLAS,
flash attention, the sampler's, Triton's from its disk cache): about 0.45 s on an H200,
more than the attach itself. None of that needs the real weights, only tensors of their
shapes and dtypes. So, on a single CUDA device, a one-layer copy of the model with
uninitialized weights (the embedding, one decoder layer, the head: about 2.5 GB for an 8B
model) runs the runner's warm-up in a thread while the main thread attaches the weights;
it is freed before the KV cache is sized. The real warm-up that follows then finds its
kernels loaded. Failing here (memory, anything the shadow cannot run) only loses the
overlap: the real warm-up loads what is missing.
"""

from __future__ import annotations

import threading
import time

import msgspec
import structlog
import torch

from engine.kvcache import KVCache
from engine.model import LlamaForCausalLM, TPGroup
from engine.modelargs import ModelArgs

log = structlog.get_logger("engine.prewarm")
SHADOW_KV_MB = 16


class Prewarm:
    def __init__(self, args: ModelArgs, dtype: torch.dtype, fp8: bool, device: torch.device):
        self.args, self.dtype, self.fp8, self.device = args, dtype, fp8, device
        self.ms = 0.0
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, name="prewarm", daemon=True)

    @classmethod
    def start(
        cls, args: ModelArgs, tp: TPGroup, dtype: torch.dtype, fp8: bool, device: torch.device
    ) -> Prewarm | None:
        """Start it where it helps: one CUDA device, no tensor parallelism (a shadow
        forward would join the group's collectives)."""
        if device.type != "cuda" or tp.size != 1:
            return None
        p = cls(args, dtype, fp8, device)
        p._thread.start()
        return p

    def join(self) -> None:
        self._thread.join()
        torch.cuda.empty_cache()  # the shadow's memory back before the KV cache is sized
        log.info("kernels preloaded", ms=round(self.ms, 1), error=self.error)

    def _run(self) -> None:
        from engine.runner import Runner  # the runner imports this module's users

        t0 = time.perf_counter()
        try:
            torch.cuda.set_device(self.device)
            one = msgspec.structs.replace(self.args, num_hidden_layers=1)
            model = LlamaForCausalLM(
                one, TPGroup(), self.dtype, fp8=self.fp8, device=str(self.device)
            )
            model.to_empty(device=self.device)
            cache = KVCache(
                1,
                one.num_key_value_heads,
                one.head_dim,
                SHADOW_KV_MB,
                self.dtype,
                self.device,
            )
            Runner(model, self.device, cache, max_batch=1, max_len=64, cuda_graphs=False).warmup()
            torch.cuda.synchronize(self.device)
            del model, cache
        except (RuntimeError, ValueError) as e:  # out of memory included: only the overlap lost
            self.error = f"{type(e).__name__}: {e}"[:300]
        self.ms = (time.perf_counter() - t0) * 1000
