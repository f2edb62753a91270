#!/usr/bin/env bash
# Download the wheels a bare GPU machine (Python 3.12, torch and aiohttp already there, no
# internet) needs for the supervisor and the chaos suite into .whl/; bench/gpu_run.sh
# installs .whl/*.whl there. Versions: the ones installed here, so both sides match.
#   scripts/carry-wheels.sh [PACKAGE ...]   (default: the list below)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
pkgs=${*:-msgspec pyzmq aiomqtt paho-mqtt structlog prometheus_client blake3}
mkdir -p .whl
for pkg in $pkgs; do
  version=$(python3 -m pip show "$pkg" 2>/dev/null | awk '/^Version:/ {print $2}')
  [ -n "$version" ] || { echo "$pkg is not installed here; install it or name a version" >&2; exit 2; }
  rm -f .whl/"$(echo "$pkg" | tr - _)"-*.whl
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .whl "$pkg==$version"
done
ls -1 .whl; du -sh .whl
