"""Whether vLLM, and the holdfast_vllm plugin, are installed for the python a policy's vLLM
engines run on (`engines.vllm.python`, else the venv of scripts/install-vllm.sh): looked at
from outside, in a subprocess of that python; nothing here imports vLLM."""

from __future__ import annotations

import subprocess
from pathlib import Path

from supervisor.kinds.vllm_spec import DEFAULT_VENV, VENV_ENV, VllmSpec, python_of

INSTALL = "bash scripts/install-vllm.sh"


def installed_errors(v: VllmSpec) -> list[str]:
    """Whether vLLM (and, for loader holdfast, the plugin) is installed for `v`'s python."""
    py = python_of(v)
    where = "engines.vllm.python at a python" if v.python else f"${VENV_ENV} at a venv"
    if not Path(py).is_file():
        return [
            f"$.engines.kind: vllm, but vLLM is not installed here ({py} does not exist); "
            f"install it with `{INSTALL}` (a venv at {DEFAULT_VENV}), or point {where} "
            "that has vLLM"
        ]
    missing = _missing_modules(py, ["vllm"] + (["holdfast_vllm"] if v.loader == "holdfast" else []))
    if "vllm" in missing:
        return [
            f"$.engines.kind: vllm, but {py} cannot import vllm; install it with "
            f"`{INSTALL}`, or point {where} that has vLLM"
        ]
    if missing:
        return [
            f"$.engines.vllm.loader: holdfast, but {py} has no holdfast_vllm plugin; install "
            f"it with `{INSTALL}`, or set engines.vllm.loader: auto (vLLM reads the checkpoint)"
        ]
    untested = _untested(py) if v.loader == "holdfast" else ""
    return [f"$.engines.vllm.python: {untested}"] if untested else []


def _untested(python: str) -> str:
    """The plugin's refusal of `python`'s vLLM version, "" when it is one tested."""
    probe = (
        "from holdfast_vllm import check_version; from holdfast_vllm.errors import PluginError\n"
        "try:\n    check_version()\nexcept PluginError as e:\n    print(e)"
    )
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""  # the other checks say what is wrong with this python
    return done.stdout.strip() if done.returncode == 0 else ""


def _missing_modules(python: str, names: list[str]) -> list[str]:
    """Which of `names` `python` cannot find (found, not imported: vLLM takes seconds)."""
    probe = (
        "import importlib.util, sys; "
        "print(' '.join(n for n in sys.argv[1:] if importlib.util.find_spec(n) is None))"
    )
    try:
        done = subprocess.run(
            [python, "-c", probe, *names], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        return list(names)
    return done.stdout.split() if done.returncode == 0 else list(names)
