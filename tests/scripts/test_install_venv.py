"""scripts/install.sh on an externally managed Python (PEP 668, as Debian's python3 is) makes
a venv and installs there; on any other Python it installs into that Python.

The externally managed Python is real: a copy of this test's interpreter binary whose stdlib
dir (symlinks to the real one) holds an EXTERNALLY-MANAGED file, so pip itself refuses it.
Only install.sh's choice of interpreter (`--python`: detection, and the venv made with the
stdlib's own venv and ensurepip, offline) runs here, not the download of torch; the venv
then installs a one-module wheel with `--no-deps --no-index` where the managed Python
refused it, and holdfast's dependencies are made visible to it by a .pth file naming this
interpreter's site-packages, to run `python3 -m supervisor` from the checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
INSTALL = REPO / "scripts" / "install.sh"


def base_python() -> Path:
    """This interpreter's real binary, outside any venv."""
    base = Path(getattr(sys, "_base_executable", sys.executable)).resolve()
    if Path(sys.base_prefix) not in base.parents:
        pytest.skip(f"{base} is not under {sys.base_prefix}: cannot copy this Python")
    return base


def fake_managed_python(root: Path) -> Path:
    """<root>/bin/python3: this Python, with EXTERNALLY-MANAGED in its stdlib dir."""
    stdlib = Path(sysconfig.get_path("stdlib", vars={"installed_base": sys.base_prefix}))
    lib = root / "lib" / stdlib.name
    lib.mkdir(parents=True)
    for entry in stdlib.iterdir():
        if entry.name not in ("site-packages", "dist-packages", "EXTERNALLY-MANAGED"):
            (lib / entry.name).symlink_to(entry)
    (lib / "site-packages").mkdir()
    (lib / "EXTERNALLY-MANAGED").write_text("[externally-managed]\nError=use a venv\n")
    (root / "bin").mkdir()
    python = root / "bin" / "python3"
    shutil.copy2(base_python(), python)
    return python


def probe_wheel(where: Path) -> Path:
    """A one-module wheel (hf_probe 1.0), to install offline."""
    wheel = where / "hf_probe-1.0-py3-none-any.whl"
    info = "hf_probe-1.0.dist-info"
    files = {
        "hf_probe.py": "",
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: hf-probe\nVersion: 1.0\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(wheel, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return wheel


def run(*args: str | Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )


def test_an_externally_managed_python_gets_a_venv(tmp_path: Path) -> None:
    fake = fake_managed_python(tmp_path / "py")
    pip_refuses = run(
        fake,
        "-m",
        "pip",
        "install",
        "--no-index",
        "holdfast",
        PYTHONPATH=sysconfig.get_path("purelib"),
    )
    assert "externally-managed-environment" in pip_refuses.stderr  # the fixture is real
    venv = tmp_path / "venv"
    chose = run("bash", INSTALL, "--python", PYTHON=str(fake), HOLDFAST_VENV=str(venv))
    assert chose.returncode == 0, chose.stderr
    assert chose.stdout.strip() == str(venv / "bin" / "python")
    prefixes = run(venv / "bin" / "python", "-c", "import sys; print(sys.prefix, sys.base_prefix)")
    assert prefixes.stdout.split() == [str(venv), str(tmp_path / "py")]
    again = run("bash", INSTALL, "--python", PYTHON=str(fake), HOLDFAST_VENV=str(venv))
    assert again.stdout.strip() == str(venv / "bin" / "python")  # the same venv, kept
    (
        venv
        / "lib"
        / f"python{sys.version_info.major}.{sys.version_info.minor}"
        / "site-packages"
        / "deps.pth"
    ).write_text(sysconfig.get_path("purelib") + "\n" + sysconfig.get_path("platlib") + "\n")
    wheel = probe_wheel(tmp_path)
    installed = run(
        venv / "bin" / "python", "-m", "pip", "install", "--no-index", "--no-deps", wheel
    )
    assert installed.returncode == 0, installed.stderr  # where the managed python refused
    assert run(venv / "bin" / "python", "-c", "import hf_probe").returncode == 0
    # the README's `python3 -m supervisor ...` from the checkout, by the managed python:
    # it runs again in the venv, and says where that is
    validate = run(fake, "-m", "supervisor", "validate", HOLDFAST_VENV=str(venv))
    assert validate.returncode == 0, validate.stderr
    assert "demo.yaml: ok" in validate.stdout
    assert f"holdfast is installed in the venv {venv}" in validate.stderr


def test_a_python_that_is_not_externally_managed_is_used_as_is(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    chose = run("bash", INSTALL, "--python", PYTHON=sys.executable, HOLDFAST_VENV=str(venv))
    assert chose.returncode == 0, chose.stderr
    assert chose.stdout.strip() == sys.executable
    assert not venv.exists()


def test_a_venv_path_that_is_no_venv_is_refused(tmp_path: Path) -> None:
    fake = fake_managed_python(tmp_path / "py")
    (tmp_path / "venv").write_text("not a venv")
    chose = run("bash", INSTALL, "--python", PYTHON=str(fake), HOLDFAST_VENV=str(tmp_path / "venv"))
    assert chose.returncode == 1
    assert f"{tmp_path / 'venv'} exists but holds no venv" in chose.stderr
