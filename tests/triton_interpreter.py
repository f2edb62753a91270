"""Triton kernels on a CPU machine: a child process runs them in Triton's interpreter.

TRITON_INTERPRET must be set before triton makes a kernel, and the test process may have
made some already; the child prints one JSON line last, which is what comes back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def run_interpreted(child: str, arg: object, timeout_s: float = 600) -> dict[str, Any]:
    """Run `child` (Python source; its argv[1] is `arg` as JSON) in the interpreter; the
    JSON object its last line of output holds."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", child, json.dumps(arg)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return dict(json.loads(proc.stdout.splitlines()[-1]))
