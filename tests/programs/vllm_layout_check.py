"""Run in the vLLM venv: for each tensor-parallel rank of TP_SIZE, the pool
`cachedaemon serve --layout vllm` builds (holdfast_vllm.layout.build_pool, memfd) beside
what vLLM's own DefaultModelLoader reads from the checkpoint's files for that rank under the same TP group. Writes
OUT/rank-R.safetensors (the pool's tensors) and prints one JSON line
{"ranks": [{"names": [...], "differ": [...], "missing": [...]}, ...]}.

    python tests/programs/vllm_layout_check.py MODEL TP_SIZE OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def rank_report(model: str, tp: int, rank: int, out: Path) -> dict[str, Any]:
    import torch
    from safetensors.torch import save_file
    from vllm.config import LoadConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.utils import (
        initialize_model,
        process_weights_after_loading,
    )
    from vllm.utils.torch_utils import set_default_torch_dtype

    from cachedaemon.backends import get_backend
    from cachedaemon.config import LoadOptions
    from holdfast_vllm import layout

    opts = LoadOptions(dtype="float32", tp_size=tp, tp_rank=rank, layout="vllm")
    pool, _ = layout.build_pool(model, opts, get_backend("memfd", "cpu"), "check")
    ours = {n: t.clone() for n, t in pool.tensors().items()}
    pool.close()
    config = layout.vllm_config(model, opts)
    model_config, cpu = config.model_config, torch.device("cpu")
    with set_current_vllm_config(config), layout.tensor_parallel(tp, rank):
        with set_default_torch_dtype(model_config.dtype), cpu:
            theirs = initialize_model(vllm_config=config, model_config=model_config)
        DefaultModelLoader(LoadConfig()).load_weights(theirs, model_config)
        with layout.shared_gemm():
            process_weights_after_loading(theirs, model_config, cpu)
    params = dict(theirs.named_parameters())
    save_file(ours, out / f"rank-{rank}.safetensors")
    return {
        "names": sorted(ours),
        "differ": sorted(n for n in ours if n not in params or not torch.equal(ours[n], params[n])),
        "missing": sorted(n for n in params if n not in ours),
    }


def main() -> None:
    model, tp, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    ranks = [rank_report(model, tp, r, out) for r in range(tp)]
    print(json.dumps({"ranks": ranks}), flush=True)


if __name__ == "__main__":
    main()
