"""`python -m engine`; the clock for startup phases starts on this module's first line."""

import time

T0 = time.perf_counter()

from engine.cli import main  # noqa: E402

raise SystemExit(main(t0=T0))
