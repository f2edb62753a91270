#!/usr/bin/env bash
# Install holdfast and its test tools into the current Python. torch first, so that pip
# takes the local CPU build instead of pulling a multi-GB CUDA one.
#
# A Python that is externally managed (PEP 668: an EXTERNALLY-MANAGED file in its stdlib
# dir, as Debian's and Ubuntu's python3 have; pip refuses to install into it) gets a venv
# instead: $HOLDFAST_VENV, default ./.venv, made once and installed into. Activate it
# (`source .venv/bin/activate`) to run holdfast's commands from that shell.
#
#   scripts/install.sh            install (into the venv when one is needed)
#   scripts/install.sh --python   print the path of the interpreter holdfast is installed
#                                 in (the venv's, made when needed, or $PYTHON's);
#                                 installs nothing
#
# The install is editable (`pip install -e`): the interpreter imports holdfast from this
# checkout, so a `git pull` here is what runs next. Moving or deleting the checkout breaks
# `python3 -m supervisor` (and every holdfast command) for that interpreter, wherever it is
# started: run install.sh again from the new place, or `pip uninstall holdfast`.
#
# PYTHON: the interpreter to start from (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${HOLDFAST_VENV:-$PWD/.venv}

die() { echo "install.sh: $*" >&2; exit 1; }

externally_managed() {  # PY: 0 when pip refuses to install into it (PEP 668), as pip decides
  "$1" - <<'PY'
import os, sys, sysconfig
in_venv = sys.prefix != getattr(sys, "base_prefix", sys.prefix)
marker = os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")
sys.exit(0 if not in_venv and os.path.isfile(marker) else 1)
PY
}

USED_VENV=""
choose_python() {  # sets PY to the interpreter to install into
  command -v "$PY" >/dev/null || die "no Python at '$PY'; install python3 (3.11+) or set PYTHON"
  externally_managed "$PY" || return 0
  if [ ! -x "$VENV/bin/python" ]; then
    [ ! -e "$VENV" ] || die "$VENV exists but holds no venv (no bin/python); remove it or set HOLDFAST_VENV"
    "$PY" -m venv "$VENV" >&2 ||
      die "$PY is externally managed (PEP 668) and could not make a venv at $VENV; install the venv module (apt-get install -y python3-venv) or set HOLDFAST_VENV"
  fi
  PY=$VENV/bin/python
  USED_VENV=$VENV
}

choose_python
if [ "${1:-}" = --python ]; then
  "$PY" -c 'import sys; print(sys.executable)'
  exit 0
fi
[ $# = 0 ] || die "usage: scripts/install.sh [--python]"
if ! $PY -c 'import torch, sys; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(v < (2, 4))' 2>/dev/null; then
  $PY -m pip install -q torch==2.13.0
fi
$PY -m pip install -q -e '.[dev,hf]'
cat >&2 <<EOF
install.sh: holdfast is installed editable into $("$PY" -c 'import sys; print(sys.executable)'):
it runs the code of this checkout, $PWD, so moving or deleting the checkout breaks
holdfast's commands for that Python; run install.sh again from the new place.
EOF
if [ -n "$USED_VENV" ]; then
  cat >&2 <<EOF
install.sh: ${PYTHON:-python3} is externally managed (PEP 668), so holdfast is installed in
the venv $USED_VENV. Activate it in your shell before holdfast's commands:

    source $USED_VENV/bin/activate

(\`python3 -m supervisor\` run from this checkout finds the venv by itself.)
EOF
fi
