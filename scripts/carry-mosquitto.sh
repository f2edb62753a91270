#!/usr/bin/env bash
# Copy this machine's mosquitto and the shared libraries it links (as `ldd` lists them,
# except libc, libm, libresolv and the dynamic loader, which every Linux has) into .mqtt/,
# with a wrapper .mqtt/mosquitto that runs it against them. Carry .mqtt/ to a machine
# without a broker (bench/gpu_run.sh chaos runs the wrapper there).
#   scripts/carry-mosquitto.sh [DEST]      (default: .mqtt in the repo root)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest=${1:-$root/.mqtt}
bin=${MOSQUITTO:-/usr/sbin/mosquitto}
[ -x "$bin" ] || { echo "no mosquitto at $bin; install it or set MOSQUITTO=/path" >&2; exit 2; }
rm -rf "$dest"; mkdir -p "$dest/lib"
cp "$bin" "$dest/mosquitto.bin"
ldd "$bin" | awk '/=> \// {print $3}' | while read -r lib; do
  case $(basename "$lib") in
    libc.so.*|libm.so.*|libresolv.so.*|ld-linux*) ;;
    *) cp -L "$lib" "$dest/lib/" ;;
  esac
done
cat > "$dest/mosquitto" <<'WRAP'
#!/bin/sh
# mosquitto with the libraries it was carried with
here=$(cd "$(dirname "$0")" && pwd)
LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/mosquitto.bin" "$@"
WRAP
chmod +x "$dest/mosquitto" "$dest/mosquitto.bin"
echo "$dest: mosquitto and $(ls "$dest/lib" | wc -l) libraries, $(du -sh "$dest" | cut -f1)"
