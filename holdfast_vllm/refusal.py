"""The plugin's refusal as the last line a vLLM process prints.

A refusal is raised in the EngineCore (or its worker), and vLLM then prints its traceback,
and the API server its own error after that. `arm` (in every process the plugin is loaded
in: the first one, the API server or an in-process LLM, owns it) names a file in the
environment, which the processes it starts inherit; `record` writes the refusal there,
and the owner prints it at its exit, after everything vLLM printed.
Imports neither torch nor vLLM.
"""

from __future__ import annotations

import atexit
import os
import sys
import tempfile
from pathlib import Path

ENV = "HOLDFAST_VLLM_REFUSAL"


def arm() -> None:
    """In the first process of a vLLM run: name the file and print it at exit."""
    if os.environ.get(ENV):
        return
    path = Path(tempfile.gettempdir()) / f"holdfast-vllm-refusal-{os.getpid()}"
    path.unlink(missing_ok=True)
    os.environ[ENV] = str(path)
    atexit.register(_print_at_exit, path, os.getpid())


def record(message: str) -> None:
    """Leave `message` for the owner to print last (printed at this process's exit when
    no owner armed one)."""
    path = os.environ.get(ENV)
    if not path:
        atexit.register(_print, message)
        return
    try:
        Path(path).write_text(message)
    except OSError:
        atexit.register(_print, message)


def _print_at_exit(path: Path, owner: int) -> None:
    if os.getpid() != owner:  # a fork of the owner
        return
    try:
        message = path.read_text()
    except OSError:
        return
    path.unlink(missing_ok=True)
    _print(message)


def _print(message: str) -> None:
    sys.stderr.flush()
    print(f"holdfast: the weights were not attached: {message}", file=sys.stderr, flush=True)
