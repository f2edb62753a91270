#!/usr/bin/env bash
# Make sure an MQTT broker answers; print `export HOLDFAST_MQTT_HOST=.. HOLDFAST_MQTT_PORT=..`.
# Uses the one on 127.0.0.1:1883 when it answers, else starts mosquitto on a free port.
set -euo pipefail
PY=${PYTHON:-python3}
answers() {
  $PY - "$1" <<'PYEOF'
import socket, sys
port = int(sys.argv[1])
try:
    s = socket.create_connection(("127.0.0.1", port), timeout=2)
    # MQTT 3.1.1 CONNECT, clean session, client id "hf-probe"
    s.sendall(bytes([0x10, 20, 0, 4]) + b"MQTT" + bytes([4, 2, 0, 10, 0, 8]) + b"hf-probe")
    ack = s.recv(4)
    sys.exit(0 if ack[:1] == b"\x20" and ack[3:4] == b"\x00" else 1)
except OSError:
    sys.exit(1)
PYEOF
}
if answers 1883; then
  echo "export HOLDFAST_MQTT_HOST=127.0.0.1 HOLDFAST_MQTT_PORT=1883"
  exit 0
fi
if ! command -v mosquitto >/dev/null && [ ! -x /usr/sbin/mosquitto ]; then
  echo "no MQTT broker answers on 127.0.0.1:1883; installing mosquitto" >&2
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mosquitto) >&2
fi
MOSQ=$(command -v mosquitto || echo /usr/sbin/mosquitto)
PORT=$($PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
CONF=$(mktemp /tmp/holdfast-mosquitto.XXXXXX.conf)
printf 'listener %s 127.0.0.1\nallow_anonymous true\n' "$PORT" > "$CONF"
"$MOSQ" -d -c "$CONF" >&2
for _ in $(seq 50); do answers "$PORT" && break; sleep 0.1; done
answers "$PORT" || { echo "mosquitto did not start on port $PORT" >&2; exit 1; }
echo "started mosquitto on 127.0.0.1:$PORT" >&2
echo "export HOLDFAST_MQTT_HOST=127.0.0.1 HOLDFAST_MQTT_PORT=$PORT"
