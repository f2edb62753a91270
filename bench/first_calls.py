"""The first call of each kind of CUDA op in a fresh process, which is what an engine's
warm-up pays (lazy kernel loading, library handles), per SDPA backend.

    python bench/first_calls.py --device cuda:0
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def child(device: str, backend: str) -> dict[str, float]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out: dict[str, float] = {}
    t = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal t
        torch.cuda.synchronize()
        now = time.perf_counter()
        out[name] = round((now - t) * 1000, 1)
        t = now

    x = torch.empty(1, device=device)
    lap("context")
    emb = torch.randn(128256, 4096, device=device, dtype=torch.bfloat16)
    lap("randn")
    h = F.embedding(torch.tensor([1, 2, 3], device=device), emb)
    lap("embedding")
    w = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    y = F.linear(h, w)
    lap("linear_first")
    y = F.linear(h[:1], w)
    lap("linear_m1")
    q = torch.randn(1, 32, 3, 128, device=device, dtype=torch.bfloat16)
    k = torch.randn(1, 32, 3, 128, device=device, dtype=torch.bfloat16)
    backends = {
        "default": None,
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
    }
    b = backends[backend]
    if b is None:
        F.scaled_dot_product_attention(q, k, k, is_causal=True)
    else:
        with sdpa_kernel(b):
            F.scaled_dot_product_attention(q, k, k, is_causal=True)
    lap("sdpa_" + backend)
    logits = torch.randn(2, 128256, device=device)
    torch.topk(torch.log_softmax(logits, -1), 20, dim=-1)
    lap("logsoftmax_topk")
    torch.argmax(logits, -1).tolist()
    lap("argmax")
    del x, y
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--child", default="")
    p.add_argument("--repeat", type=int, default=2)
    a = p.parse_args()
    if a.child:
        print("RESULT " + json.dumps(child(a.device, a.child)))
        return 0
    import torch

    print("arch list", torch.cuda.get_arch_list(), torch.version.cuda, flush=True)
    for backend in ("default", "flash", "cudnn", "efficient"):
        for _ in range(a.repeat):
            r = subprocess.run(
                [sys.executable, __file__, "--child", backend, "--device", a.device],
                capture_output=True,
                text=True,
                check=False,
            )
            line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
            print(backend, line[0][7:] if line else r.stderr[-800:], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
