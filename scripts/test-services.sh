#!/usr/bin/env bash
# The programs the tests start themselves, each on free loopback ports: mosquitto (the
# MQTT broker) and etcd (the fleet). Installed from Debian's packages when missing;
# nothing is started here, and nothing the machine already runs is used.
set -euo pipefail
missing=()
command -v mosquitto >/dev/null || [ -x /usr/sbin/mosquitto ] || missing+=(mosquitto)
command -v etcd >/dev/null || missing+=(etcd-server)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ] && ! command -v sudo >/dev/null; then
    echo "the tests need ${missing[*]}: install them (Debian: apt-get install ${missing[*]})" >&2
    exit 1
  fi
  SUDO=$([ "$(id -u)" -eq 0 ] && echo "" || echo sudo)
  echo "installing ${missing[*]} (the tests start their own broker and etcd)" >&2
  $SUDO apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >&2
fi
# Debian starts the packaged daemons on install; the tests never use them (free ports).
