"""`python -m engine`: parse flags/env, then hand over to engine.app (which imports torch)."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

from holdfast_contract.errors import HoldfastError


def main(
    argv: Sequence[str] | None = None, *, t0: float | None = None, spare_ms: float = 0.0
) -> int:
    t0 = time.perf_counter() if t0 is None else t0
    from engine.config import from_args, log_format
    from holdfast_contract import logs

    try:
        cfg = from_args(argv)
        logs.setup(log_format(cfg))
        from engine import app

        return app.run(cfg, t0, spare_ms)
    except HoldfastError as e:
        print(f"engine: error: {e}", file=sys.stderr)
        return 2
