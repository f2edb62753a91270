"""`python -m supervisor`: the same as the `supervisor` command.

Started from this checkout by an interpreter that lacks holdfast's dependencies (a system
python3 that is externally managed, PEP 668) while the venv `scripts/install.sh` made for it
exists, it runs again in that venv's python, and says so.
"""

import os
import sys
from pathlib import Path

try:
    from supervisor.cli import main
except ModuleNotFoundError as missing:
    root = Path(__file__).resolve().parents[1]
    venv = Path(os.environ.get("HOLDFAST_VENV") or root / ".venv").absolute()
    python = venv / "bin" / "python"
    if not python.is_file() or os.environ.get("HOLDFAST_IN_VENV") == str(venv):
        sys.exit(f"supervisor: {missing}; install holdfast first: bash scripts/install.sh")
    print(
        f"supervisor: holdfast is installed in the venv {venv}; running there "
        f"(`source {venv}/bin/activate` to use it directly)",
        file=sys.stderr,
    )
    os.environ["HOLDFAST_IN_VENV"] = str(venv)
    os.execv(python, [str(python), "-m", "supervisor", *sys.argv[1:]])

sys.exit(main())
