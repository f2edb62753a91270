"""The test tree's folders are named for the packages they test (tests/cachedaemon, tests/
supervisor, ...). A program run by path from tests/ itself would have tests/ first on its
sys.path, where those folders are namespace packages that hide the real ones from an
editable install's finder (`import holdfast_vllm` would find tests/holdfast_vllm). So the
programs that tests run by path live in tests/programs/ (or tests/engines/), never in tests/."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
# a program's path as tests build it: REPO / "tests" / "x.py"
BY_PATH = re.compile(r'"tests"\s*/\s*"(\w+\.py)"')


def test_no_test_runs_a_program_from_the_top_of_the_tree() -> None:
    top = {p.name for p in TESTS.glob("*.py")}
    found = [
        f"{src.relative_to(REPO)}: {name}"
        for src in TESTS.rglob("*.py")
        for m in BY_PATH.finditer(src.read_text())
        if (name := m.group(1)) in top
    ]
    assert not found, f"move these programs to tests/programs/: {found}"


def test_a_program_there_imports_the_real_packages(tmp_path: Path) -> None:
    probe = TESTS / "programs" / "where_packages_are.py"
    out = subprocess.run(
        [sys.executable, str(probe)],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    ).stdout
    lines = out.splitlines()
    assert len(lines) == 6, out
    for line in lines:
        name, _, where = line.partition(" ")
        # a package's own __init__.py (wherever it is installed), not a namespace of tests/
        assert where.endswith(f"/{name}/__init__.py") and not where.startswith(str(TESTS)), line
