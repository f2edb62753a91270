"""`scripts/install.sh --python` prints the path of the interpreter holdfast is installed in,
as the README says, not the name it was started by (`python3`), so `"$(... --python)" -m X`
runs the same Python from any directory and any PATH."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_install_python_prints_an_absolute_interpreter_path(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python3 = bin_dir / "python3"  # `python3` on PATH, as a shell finds it
    python3.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python3.chmod(0o755)
    e = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    e["PATH"] = f"{bin_dir}{os.pathsep}{e['PATH']}"
    e["HOLDFAST_VENV"] = str(tmp_path / "venv")  # made here if this Python is managed
    cp = subprocess.run(
        ["bash", str(REPO / "scripts" / "install.sh"), "--python"],
        env=e,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert cp.returncode == 0, cp.stderr
    printed = cp.stdout.strip()
    assert os.path.isabs(printed), printed
    same = subprocess.run(
        [printed, "-c", "import sys; print(sys.executable)"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert same.stdout.strip() == printed
