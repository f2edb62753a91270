#!/usr/bin/env bash
# A fleet of nodes on one machine, for tests: network namespaces joined by a bridge, and a
# 3-member etcd cluster in namespaces of its own. Needs root and iproute2. Traffic stays
# between these namespaces: the bridge has no address in the host's namespace, and while a
# fleet is up the host holds an `unreachable` route for the fleet's subnet (added before the
# bridge, removed last by `down`), so a host-side connect to a fleet address fails at once
# with EHOSTUNREACH instead of leaving through the default gateway.
#
#   scripts/fleet.sh up N          nodes hf-n1..hf-nN (10.77.0.1..N), etcd in hf-e1..hf-e3
#                                  (10.77.0.201..203:2379), a client namespace hf-c1
#                                  (10.77.0.100: the host has no address on the bridge, so
#                                  load and probes run there); prints HF_FLEET_ETCD=<endpoints>
#   scripts/fleet.sh down          removes namespaces, links, etcd processes and data dirs;
#                                  safe to run again, or when nothing is up
#   scripts/fleet.sh isolate NODE  cuts NODE (hf-n2 or n2) off: its link to the bridge down
#   scripts/fleet.sh rejoin NODE   ... and back
#   scripts/fleet.sh exec NODE CMD...  runs CMD inside NODE's namespace
#   scripts/fleet.sh health        each etcd member's /health
#   scripts/fleet.sh stop-member I...   kill -9 etcd members eI (1-3)
#   scripts/fleet.sh start-member I...  ... start them again on their data dirs, wait for /health
#   scripts/fleet.sh endpoints     the etcd endpoints, comma-separated
#
# HF_FLEET_PREFIX: the names' prefix (default hf: namespaces hf-n1, hf-e1, hf-c1, bridge
# hf-br0, host-side links hfv-n1); 1-6 lower-case letters or digits, a letter first.
# HF_FLEET_SUBNET: the fleet's /24 as its first three octets (default 10.77.0). Two fleets
# up at once need each their own prefix and subnet.
# HF_FLEET_STATE: where etcd data, logs and pids go (default /tmp/<prefix>-fleet).
# HF_FLEET_ETCD_FLAGS: more etcd flags, e.g. "--heartbeat-interval 50 --election-timeout 500"
# (etcd grants no lease shorter than 1.5 x its election timeout: that lets ttl_s be 1).
#
# Example:
#   sudo scripts/fleet.sh up 3 && sudo scripts/fleet.sh exec n1 python3 -m supervisor.fleet \
#       elect --etcd 10.77.0.201:2379,10.77.0.202:2379,10.77.0.203:2379 --cluster demo \
#       --node n1 --fingerprint abc
set -euo pipefail

PREFIX=${HF_FLEET_PREFIX:-hf}
NET=${HF_FLEET_SUBNET:-10.77.0}
STATE=${HF_FLEET_STATE:-/tmp/$PREFIX-fleet}  # etcd data, logs, pids
BRIDGE=$PREFIX-br0
MEMBERS=3

die() { echo "fleet.sh: $*" >&2; exit 1; }

[[ $PREFIX =~ ^[a-z][a-z0-9]{0,5}$ ]] ||
  die "HF_FLEET_PREFIX '$PREFIX': use 1-6 lower-case letters or digits, a letter first"
[[ $NET =~ ^(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])(\.(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])){2}$ ]] ||
  die "HF_FLEET_SUBNET '$NET': give the /24's first three octets, like 10.77.0"

need() {
  [ "$(id -u)" = 0 ] || die "needs root (network namespaces); run it with sudo"
  command -v ip >/dev/null || die "needs iproute2's ip: apt-get install -y iproute2"
}

ns_name() { case $1 in "$PREFIX"-*) echo "$1" ;; *) echo "$PREFIX-$1" ;; esac; }

# host-side end of a namespace's veth: hf-n2 -> hfv-n2
host_if() { echo "${PREFIX}v-${1#"$PREFIX"-}"; }

# The host's route for the fleet's subnet: `unreachable`, so nothing the host sends to a
# fleet address leaves the machine. Added before anything of the fleet exists.
hold_subnet() {
  [ -z "$(ip route show root "$NET.0/24")" ] ||
    die "the host routes $NET.0/24 already ($(ip route show root "$NET.0/24" | head -n 1)); set HF_FLEET_SUBNET to another /24, or run fleet.sh down if a fleet left it"
  [ -z "$(ip -o addr show to "$NET.0/24")" ] ||
    die "the host has an address in $NET.0/24; set HF_FLEET_SUBNET to another /24"
  ip route add unreachable "$NET.0/24"
}

endpoints() {
  local i out=""
  for i in $(seq 1 $MEMBERS); do out+="${out:+,}$NET.$((200 + i)):2379"; done
  echo "$out"
}

add_ns() {  # NAME ADDRESS
  local ns=$1 addr=$2 hif
  hif=$(host_if "$ns")
  ip netns add "$ns"
  ip -n "$ns" link set lo up
  ip link add "$hif" type veth peer name eth0 netns "$ns"
  ip link set "$hif" master "$BRIDGE" up
  ip -n "$ns" addr add "$addr/24" dev eth0
  ip -n "$ns" link set eth0 up
}

start_member() {  # INDEX
  local i=$1 ns="$PREFIX-e$1" ip="$NET.$((200 + $1))" cluster="" j
  for j in $(seq 1 $MEMBERS); do cluster+="${cluster:+,}e$j=http://$NET.$((200 + j)):2380"; done
  mkdir -p "$STATE/e$i"
  ip netns exec "$ns" setsid etcd --name "e$i" --data-dir "$STATE/e$i/data" \
    --listen-client-urls "http://$ip:2379" --advertise-client-urls "http://$ip:2379" \
    --listen-peer-urls "http://$ip:2380" --initial-advertise-peer-urls "http://$ip:2380" \
    --initial-cluster "$cluster" --initial-cluster-token "$PREFIX-fleet" \
    --initial-cluster-state new ${HF_FLEET_ETCD_FLAGS:-} </dev/null >"$STATE/e$i/etcd.log" 2>&1 &
  echo $! >"$STATE/e$i/pid"
}

healthy() {  # INDEX: 0 when the member answers healthy
  ip netns exec "$PREFIX-e$1" python3 - "http://$NET.$((200 + $1)):2379/health" <<'PY' 2>/dev/null
import sys, urllib.request
sys.exit(b'"health":"true"' not in urllib.request.urlopen(sys.argv[1], timeout=2).read())
PY
}

wait_healthy() {
  local deadline=$((SECONDS + ${HF_FLEET_TIMEOUT:-60})) i ok
  while :; do
    ok=1
    for i in $(seq 1 $MEMBERS); do healthy "$i" || ok=0; done
    [ $ok = 1 ] && return 0
    [ $SECONDS -lt $deadline ] || { tail -n 20 "$STATE"/e*/etcd.log >&2; die "etcd not healthy"; }
    sleep 0.2
  done
}

up() {
  local n=${1:-} i
  [[ $n =~ ^[1-9][0-9]?$ ]] || die "usage: fleet.sh up N (1-99 nodes)"
  need
  command -v etcd >/dev/null || die "etcd not installed: apt-get install -y etcd-server"
  ip link show "$BRIDGE" >/dev/null 2>&1 &&
    die "a fleet is up already ($BRIDGE); run fleet.sh down, or set HF_FLEET_PREFIX"
  mkdir -p "$STATE"
  hold_subnet
  echo "$NET" >"$STATE/subnet"
  ip link add "$BRIDGE" type bridge
  ip link set "$BRIDGE" up
  for i in $(seq 1 "$n"); do add_ns "$PREFIX-n$i" "$NET.$i"; done
  for i in $(seq 1 $MEMBERS); do add_ns "$PREFIX-e$i" "$NET.$((200 + i))"; done
  add_ns "$PREFIX-c1" "$NET.100"
  echo "$n" >"$STATE/nodes"
  for i in $(seq 1 $MEMBERS); do start_member "$i"; done
  wait_healthy
  echo "HF_FLEET_ETCD=$(endpoints)"
}

stop_member() {  # PIDFILE: kill it only if it is still our etcd
  local pid
  pid=$(cat "$1" 2>/dev/null) || return 0
  if [ -r "/proc/$pid/cmdline" ] && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q "^etcd --name e"; then
    kill -9 "$pid" 2>/dev/null || true
    while [ -e "/proc/$pid" ] && ! grep -q '^State:.*Z' "/proc/$pid/status" 2>/dev/null; do
      sleep 0.05
    done
  fi
}

down() {
  need
  local f ns net=$NET
  [ -r "$STATE/subnet" ] && net=$(cat "$STATE/subnet")
  for f in "$STATE"/e*/pid; do [ -e "$f" ] && stop_member "$f"; done
  for ns in $(ip netns list | awk '{print $1}' | grep -E "^$PREFIX-(n|e|c)[0-9]+\$" || true); do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns del "$ns"
  done
  for f in $(ip -o link show | awk -F': ' '{print $2}' | cut -d@ -f1 | grep -E "^${PREFIX}v-" || true); do
    ip link del "$f" 2>/dev/null || true
  done
  ip link del "$BRIDGE" 2>/dev/null || true
  rm -rf "$STATE"
  # last, once nothing of the fleet is left to send to
  ip route del unreachable "$net.0/24" 2>/dev/null || true
}

member() {  # INDEX: checked to be one of ours
  [[ ${1:-} =~ ^[1-9]$ ]] && [ "$1" -le $MEMBERS ] || die "no etcd member '${1:-}'; members are 1-$MEMBERS"
  ip netns list | grep -qw "$PREFIX-e$1" || die "no namespace $PREFIX-e$1; is the fleet up (fleet.sh up N)?"
}

wait_member() {  # INDEX
  local deadline=$((SECONDS + ${HF_FLEET_TIMEOUT:-60}))
  until healthy "$1"; do
    [ $SECONDS -lt $deadline ] || { tail -n 20 "$STATE/e$1/etcd.log" >&2; die "etcd e$1 not healthy"; }
    sleep 0.1
  done
}

link() {  # NODE up|down
  need
  local ns
  ns=$(ns_name "${1:-}")
  ip netns list | grep -qw "$ns" || die "no namespace $ns; is the fleet up (fleet.sh up N)?"
  ip link set "$(host_if "$ns")" "$2"
}

cmd=${1:-}
shift || true
case $cmd in
  up) up "$@" ;;
  down) down ;;
  isolate) link "${1:-}" down ;;
  rejoin) link "${1:-}" up ;;
  exec)
    need
    ns=$(ns_name "${1:-}")
    shift
    exec ip netns exec "$ns" "$@"
    ;;
  stop-member)
    need
    for i in "${@:-}"; do member "$i"; done
    for i in "$@"; do stop_member "$STATE/e$i/pid"; done
    ;;
  start-member)  # all named members first, then their health: one alone has no quorum
    need
    for i in "${@:-}"; do member "$i"; done
    for i in "$@"; do start_member "$i"; done
    for i in "$@"; do wait_member "$i"; done
    ;;
  health) for i in $(seq 1 $MEMBERS); do healthy "$i" && echo "e$i healthy" || echo "e$i unhealthy"; done ;;
  endpoints) endpoints ;;
  *) die "usage: fleet.sh up N | down | isolate NODE | rejoin NODE | exec NODE CMD... | health | endpoints | stop-member I | start-member I" ;;
esac
