"""A pool's size from the checkpoint's headers alone (cachedaemon/pool_plan.py) is the
`pool_bytes` of the pool the daemon builds, for each dtype, tensor-parallel shard and
quantization; and sizing it imports no torch (the supervisor does it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cachedaemon.backends import get_backend
from cachedaemon.config import LoadOptions
from cachedaemon.pool import build_pool
from cachedaemon.pool_plan import pool_bytes
from tests.conftest import child_env


@pytest.mark.parametrize(
    "opts",
    [
        LoadOptions("float32"),
        LoadOptions("bfloat16"),
        LoadOptions("bfloat16", tp_size=2, tp_rank=1),
        LoadOptions("float32", quantization="fp8-block"),
    ],
    ids=["float32", "bfloat16", "tp2-rank1", "fp8-block"],
)
def test_the_size_from_headers_is_the_built_pools(tiny_model: Path, opts: LoadOptions) -> None:
    pool, _ = build_pool(tiny_model, opts, get_backend("memfd", "cpu"), "fp", digest=False)
    try:
        assert pool_bytes(tiny_model, opts, "memfd") == pool.manifest.pool_bytes > 0
    finally:
        pool.close()


def test_sizing_a_pool_reads_no_tensor_and_imports_no_torch(tiny_model: Path) -> None:
    code = (
        "import sys; from cachedaemon.pool_plan import pool_bytes; "
        "from cachedaemon.config import LoadOptions; "
        f"print(pool_bytes({str(tiny_model)!r}, LoadOptions('float32'), 'cuda-vmm')); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) % (2 << 20) == 0  # cuda-vmm chunks: the driver's 2 MiB granules
