#!/usr/bin/env bash
# Everything that needs the GPU machine, in one call. Writes logs and JSON under $OUT.
#   bench/gpu_run.sh [env] [tests] [probe] [moe] [lifetime] [llama]   (default: all)
# also: checksum-tests, llama-daemon, engine (the engine's GPU tests, then its startup bench),
#   startup (forked engine start to ready, 6 trials, without and with spares: STARTUP_SPARES
#     names the fork server's --spares modes, off auto ready by default; STARTUP_S bounds each),
#   batching (the batching GPU tests, then bench/engine_throughput.py with the transformers baseline),
#   checkpoint (write the llama-8b checkpoint to /tmp/models/llama-8b; a stage that needs it
#     waits for a writer already at it), checkpoint-bg (start writing it and go on: it is
#     written while the next calls' parts travel),
#   chaos / chaos-tp2 (chaos/scenarios/gpu.yaml / gpu-tp2.yaml; results in $OUT/chaos-gpu*),
#   scenario=FILE (any chaos scenario file; results in $OUT/chaos-NAME),
#   gpu-test=FILE (a test file's gpu-marked tests; $OUT/tests_NAME.txt),
#   startup-profile (bench/startup_profile.py: where a start goes before ready, cProfile'd; by default
#     the whole warm-up's steps on uninitialised weights; STARTUP_PROFILE_ARGS replaces its flags),
#   throughput-ab (bench/engine_throughput.py alone on llama-8b, once per engine --matvec in MATVECS,
#     default "cublas triton"; the first run with transformers' baseline unless THROUGHPUT_BASELINE=""),
#   decode-profile (bench/decode_profile.py: each projection's read rate, cuBLAS against the one-row
#     kernel, and a decode step's kernels; no checkpoint needed; DECODE_PROFILE_ARGS adds flags),
#   checkpoint-b-bg (write a second llama-8b, seed 1, to /tmp/models/llama-8b-b in the background),
#   checkpoints-wait (until both are written; CHECKPOINTS_S bounds it),
#   kv-tests (tests/engine/test_kvshare_gpu.py), standby-memory (bench/standby_memory.py: device
#     memory per engine, KV cache private and shared; MEMORY_S bounds it),
#   refit-tests (tests/cachedaemon/test_pool_refit.py's GPU test), update (bench/update.py on llama-8b:
#     an update to llama-8b-b under 16 streaming clients, a refit back, a stop-and-start; UPDATE_S bounds it,
#     UPDATE_ARGS adds flags, e.g. "--set update.refit_inflight=retry", UPDATE_TAG names its files),
#   update-small (the same on the small preset, two checkpoints written here),
#   load-digest (the daemon's llama-8b load with and without the content digest: bench/load_digest.py),
#   digest-tests (tests/cachedaemon/test_blake3_gpu.py: the digest hashed on the GPU equals the CPU's),
#   vllm-part (keep the carried part of vLLM, .vllm/part-NN, in /tmp/holdfast-vllm-cuda/parts),
#   vllm (once every part is kept: reassemble and check it; the stages after it run with
#     vLLM importable and HOLDFAST_VLLM_VENV set, so engines.kind vllm policies find it)
#   vllm-tiny (after vllm: bench/vllm_gpu.py's parity stage on the tiny Llama with a tokenizer,
#     $OUT/vllm_gpu_tiny.json)
#   vllm-bench (after vllm: bench/vllm_gpu.py on llama-8b, holdfast against vLLM's default
#     loader: parity, memory per engine, start to ready; $OUT/vllm_gpu.json, logs in $OUT/vllm_gpu_logs;
#     VLLM_BENCH_ARGS adds its flags, e.g. "--stages restart --prime forked --trials 1")
# Wheels for packages the GPU image lacks travel in .whl/ (scripts/carry-wheels.sh; carry
# it), the MQTT broker in .mqtt/ (scripts/carry-mosquitto.sh; carry it for the chaos stages),
# vLLM for CUDA in parts in .vllm/ (scripts/carry-vllm.sh; docs/gpu.md says in what order).
# At most 8 files come back from a call's $OUT: each stage writes under $RAW, and after each
# stage $OUT gets its summaries (*.json, *.txt, report.md at the top of $RAW) and all of $RAW
# as results.tgz, so what a stage left is back even when a later one is cut off.
set -uo pipefail
OUT=${OUT:-/tmp/holdfast-out}; mkdir -p "$OUT"
RAW=/tmp/holdfast-raw; rm -rf "$RAW"; mkdir -p "$RAW"
pack() {  # $RAW -> $OUT: the top-level summaries, and everything as one archive
  find "$RAW" -maxdepth 1 -type f \( -name '*.json' -o -name '*.txt' -o -name '*.md' \) \
    -size -16M -exec cp {} "$OUT/" \;
  tar -C "$RAW" -czf "$OUT/.results.tgz" . && mv "$OUT/.results.tgz" "$OUT/results.tgz"
}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site
fi
# the carried broker for every stage: the tests start their own from it too
[ -x .mqtt/mosquitto ] && export HOLDFAST_MOSQUITTO=$PWD/.mqtt/mosquitto
stages=${*:-env tests probe moe lifetime llama}

CKPT_LOCK=/tmp/models/.llama-8b.lock
write_checkpoint() {  # the llama-8b checkpoint the GPU policies name (model.path), once
  mkdir -p /tmp/models
  # one writer at a time (Python's flock: the image's util-linux is not relied on)
  python3 -c 'import fcntl, subprocess, sys; lock = open(sys.argv[1], "w"); fcntl.flock(lock, fcntl.LOCK_EX)
sys.exit(subprocess.call(sys.argv[2:]))' "$CKPT_LOCK" sh -c '[ -f /tmp/models/llama-8b/.complete ] || {
    rm -rf /tmp/models/llama-8b
    timeout 300 python3 -m cachedaemon make-checkpoint /tmp/models/llama-8b --preset llama-8b \
      && touch /tmp/models/llama-8b/.complete; }'
}
checkpoint() {  # written, or waited for while another call's writer is at it
  local t0=$SECONDS
  write_checkpoint 2>&1 | tail -2
  echo "checkpoint: /tmp/models/llama-8b ready after $((SECONDS - t0)) s here"
}

chaos_run() {  # NAME [FILE]: a carried broker on a free port, the chaos run, results to $OUT
  local name=$1 file=${2:-chaos/scenarios/$1.yaml} out="$RAW/chaos-$1" port rc
  [ -x .mqtt/mosquitto ] || { echo "no .mqtt/mosquitto: run scripts/carry-mosquitto.sh here and carry .mqtt"; return 2; }
  checkpoint
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  printf 'listener %s 127.0.0.1\nallow_anonymous true\npersistence false\n' "$port" > /tmp/mosquitto-chaos.conf
  .mqtt/mosquitto -c /tmp/mosquitto-chaos.conf > "$RAW/mosquitto-$name.log" 2>&1 &
  local broker=$!
  export HOLDFAST_MQTT_HOST=127.0.0.1 HOLDFAST_MQTT_PORT=$port HOLDFAST_MOSQUITTO=$PWD/.mqtt/mosquitto
  mkdir -p "$out"
  timeout -k 15 "${CHAOS_S:-560}" python3 -m chaos run "$file" --out "$out" --no-progress -v \
    > "$out/chaos.log" 2>&1
  rc=$?
  kill "$broker" 2>/dev/null; wait "$broker" 2>/dev/null
  grep -E '^(pass|FAIL|note|report)' "$out/chaos.log"; tail -5 "$out/chaos.log"
  echo "chaos $name: exit $rc"
  sed -n '1,/^## Per fault/p' "$out/report.md" 2>/dev/null
  cp "$out/report.md" "$RAW/chaos-$name-report.md" 2>/dev/null
}
VLLM_HOME=/tmp/holdfast-vllm-cuda  # outside the checkout: kept between calls while the machine is in use

vllm_part() {  # keep each carried part; say which of how many are here
  ls .vllm/part-*/COUNT >/dev/null 2>&1 ||
    { echo "no .vllm/part-NN: run scripts/carry-vllm.sh here and carry .vllm/part-NN"; return 2; }
  mkdir -p "$VLLM_HOME/parts"
  for d in .vllm/part-*; do cp -f "$d"/* "$VLLM_HOME/parts/"; done  # earlier calls' too
  echo "vLLM parts kept: $(ls "$VLLM_HOME/parts" | grep -c '^part\.') of $(cat "$VLLM_HOME/parts/COUNT")"
}

vllm_tree() {  # reassemble once; then vLLM is importable from $VLLM_HOME/site
  local parts=$VLLM_HOME/parts
  if [ ! -f "$VLLM_HOME/site/.complete" ]; then
    [ "$(ls "$parts" 2>/dev/null | grep -c '^part\.')" = "$(cat "$parts/COUNT" 2>/dev/null)" ] ||
      { echo "vLLM: $(ls "$parts" 2>/dev/null | grep -c '^part\.') parts kept, $(cat "$parts/COUNT" 2>/dev/null || echo '?') needed: send the rest with vllm-part"; return 2; }
    cat "$parts"/part.* > "$VLLM_HOME/vllm-tree.tar.xz"
    (cd "$VLLM_HOME" && sha256sum -c "$parts/SHA256SUMS") || { echo "vLLM: the parts do not make the archive (sha256)"; return 2; }
    rm -rf "$VLLM_HOME/site"; mkdir -p "$VLLM_HOME/site"
    xz -d -T0 < "$VLLM_HOME/vllm-tree.tar.xz" | tar -C "$VLLM_HOME/site" -xf - || return 2
    rm -f "$VLLM_HOME/vllm-tree.tar.xz"; touch "$VLLM_HOME/site/.complete"
  fi
  # a "venv" whose python sees the carried tree: what engines.kind vllm runs (supervisor/kinds/vllm_spec.py)
  mkdir -p "$VLLM_HOME/venv/bin"
  printf '#!/bin/sh\nexport PYTHONPATH="%s"\nexec python3 "$@"\n' "$PWD:$VLLM_HOME/site" > "$VLLM_HOME/venv/bin/python"
  chmod +x "$VLLM_HOME/venv/bin/python"
  export HOLDFAST_VLLM_VENV=$VLLM_HOME/venv PYTHONPATH=$PYTHONPATH:$VLLM_HOME/site
  # flashinfer is not carried: vLLM's sampler must not ask for it
  export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
  "$HOLDFAST_VLLM_VENV/bin/python" -c 'import vllm, holdfast_vllm, importlib.metadata as m; print("vLLM", vllm.__version__, "plugin:", [e.value for e in m.entry_points(group="vllm.general_plugins")])'
}

OUT_GIVEN=$OUT OUT=$RAW  # the stages write under $RAW; pack() copies to $OUT_GIVEN
for stage in $stages; do
  echo "=== $stage $(date -u +%H:%M:%S)"
  case $stage in
    env)
      { nvidia-smi; python3 -V; nproc; free -g; df -h /tmp; uname -r
        python3 -c "import torch, cuda.bindings as cb; print(torch.__version__, torch.version.cuda, cb.__version__, torch.cuda.get_device_capability())"
        python3 -m pip list 2>/dev/null | grep -iE "^(torch|safetensors|numpy|cuda|msgspec|pyzmq|structlog|prometheus_client|aiomqtt|paho|rich|pytest|aiohttp|pyyaml) "
        sync; echo 3 > /proc/sys/vm/drop_caches && echo "drop_caches: ok"
      } 2>&1 | tee "$OUT/env.txt" ;;
    digest-tests)  # the GPU's BLAKE3 against the CPU's
      timeout 180 python3 -m pytest -q -p no:cacheprovider tests/cachedaemon/test_blake3_gpu.py 2>&1 | tee "$OUT/tests_digest.txt" ;;
    checksum-tests)
      timeout 60 python3 -m pytest -q -p no:cacheprovider tests/cachedaemon/test_cuda_backend.py -k checksum 2>&1 | tee "$OUT/tests_checksum.txt" ;;
    tests)
      timeout 180 python3 -m pytest -q -p no:cacheprovider tests/*/test_cuda*.py 2>&1 | tee "$OUT/tests.txt" ;;
    probe)
      timeout 300 python3 bench/cuda_vmm_probe.py --out "$OUT/h200_checksum_fp8_probe.json" 2>&1 | tail -20 ;;
    moe)
      timeout 420 python3 bench/cuda_load_bench.py --only moe --out "$OUT/h200_load_moe.json" \
        2>&1 | tee "$OUT/bench_moe.txt" ;;
    llama)
      timeout 420 python3 bench/cuda_load_bench.py --only llama-8b --out "$OUT/h200_load_llama-8b.json" \
        2>&1 | tee "$OUT/bench_llama-8b.txt" ;;
    llama-daemon)  # the daemon figures alone (no raw or safetensors reads)
      timeout 150 python3 bench/cuda_load_bench.py --only llama-8b --no-baselines \
        --out "$OUT/h200_load_llama-8b_daemon.json" 2>&1 | tee "$OUT/bench_llama-8b_daemon.txt" ;;
    engine)  # GPU engine tests while the llama-8b checkpoint is written; then startup, alone
      ( timeout 230 python3 -m pytest -q -p no:cacheprovider -rA tests/engine/test_cuda_engine.py \
          > "$OUT/engine_tests.txt" 2>&1; echo "exit $?" >> "$OUT/engine_tests.txt" ) &
      tests=$!
      [ -f /tmp/models/llama-8b/config.json ] || timeout 300 python3 -m cachedaemon \
        make-checkpoint /tmp/models/llama-8b --preset llama-8b 2>&1 | tail -2
      wait $tests; tail -40 "$OUT/engine_tests.txt"
      timeout 330 python3 bench/engine_startup.py --device cuda:0 --preset llama-8b \
        --model-dir /tmp/models/llama-8b --trials 3 --out "$OUT/h200_engine_startup_llama-8b.json" \
        2>&1 | tee "$OUT/engine_startup.txt" ;;
    batching)  # batching GPU tests while llama-8b is written; then the throughput bench
      ( timeout 300 python3 -m pytest -q -p no:cacheprovider -rA tests/engine/test_cuda_batching.py \
          tests/engine/test_cuda_engine.py > "$OUT/batching_tests.txt" 2>&1; echo "exit $?" >> "$OUT/batching_tests.txt" ) &
      tests=$!
      [ -f /tmp/models/llama-8b/config.json ] || timeout 300 python3 -m cachedaemon \
        make-checkpoint /tmp/models/llama-8b --preset llama-8b 2>&1 | tail -2
      wait $tests; tail -25 "$OUT/batching_tests.txt"
      timeout 420 python3 bench/engine_throughput.py --device cuda:0 --preset llama-8b \
        --model-dir /tmp/models/llama-8b --concurrency 1,32,128 --kv-cache-mb 16384 --baseline \
        --out "$OUT/h200_engine_throughput_llama-8b.json" 2>&1 | tee "$OUT/engine_throughput.txt" ;;
    throughput-ab)  # the throughput bench alone, once per --matvec (the first with transformers)
      checkpoint
      base=${THROUGHPUT_BASELINE---baseline}
      for mv in ${MATVECS:-cublas triton}; do
        timeout 300 python3 bench/engine_throughput.py --device cuda:0 --preset llama-8b \
          --model-dir /tmp/models/llama-8b --concurrency 1,32,128 --kv-cache-mb 16384 $base \
          --engine-flags "--matvec $mv" --out "$OUT/engine_throughput_matvec-$mv.json" 2>&1 \
          | tail -30 | tee "$OUT/engine_throughput_matvec-$mv.txt"
        base=
      done ;;
    startup)  # forked engine start to ready, alone, without and with the fork server's spares
      checkpoint  # (the first start compiles Triton's kernels if its cache is empty)
      for spares in ${STARTUP_SPARES:-off auto ready}; do  # the fork server's --spares modes
        timeout "${STARTUP_S:-200}" python3 bench/engine_startup.py --device cuda:0 --preset llama-8b \
          --model-dir /tmp/models/llama-8b --modes attach_forked --trials 6 --spares $spares \
          --out "$OUT/h200_engine_startup_forked_spares-$spares.json" 2>&1 \
          | tee "$OUT/engine_startup_forked_spares-$spares.txt"
      done ;;
    imports)  # where the engine's import time goes on this machine
      { TIMEFORMAT="%R s"
        for i in 1 2 3; do echo -n "import torch: "; time python3 -c "import torch"; done
        for i in 1 2; do echo -n "import torch (TORCH_DEVICE_BACKEND_AUTOLOAD=0): "
          time TORCH_DEVICE_BACKEND_AUTOLOAD=0 python3 -c "import torch"; done
        for i in 1 2; do echo -n "import engine.app: "; time python3 -c "import engine.app"; done
        python3 -X importtime -c "import engine.app" 2> "$OUT/importtime_engine.txt"
        sort -t'|' -k2 -n -r "$OUT/importtime_engine.txt" | head -45
      } 2>&1 | tee "$OUT/imports.txt" ;;
    nccl-tests)
      timeout 200 python3 -m pytest -q -p no:cacheprovider -rA tests/engine/test_cuda_engine.py \
        -k nccl_group 2>&1 | tee "$OUT/nccl_tests.txt" ;;
    checkpoint) checkpoint ;;
    checkpoint-b-bg)  # the second llama-8b (seed 1: same shapes, other weights), in the background
      mkdir -p /tmp/models
      setsid nohup sh -c '[ -f /tmp/models/llama-8b-b/.complete ] || { rm -rf /tmp/models/llama-8b-b
        timeout 400 python3 -m cachedaemon make-checkpoint /tmp/models/llama-8b-b --preset llama-8b --seed 1 \
          && touch /tmp/models/llama-8b-b/.complete; }' > /tmp/models/writer-b.log 2>&1 < /dev/null &
      echo "checkpoint: writing /tmp/models/llama-8b-b in the background" ;;
    checkpoints-wait)  # both llama-8b checkpoints written (by checkpoint-bg and checkpoint-b-bg)
      t0=$SECONDS
      while { [ ! -f /tmp/models/llama-8b/.complete ] || [ ! -f /tmp/models/llama-8b-b/.complete ]; } \
        && [ $((SECONDS - t0)) -lt "${CHECKPOINTS_S:-400}" ]; do sleep 2; done
      ls -d /tmp/models/llama-8b*/.complete; echo "checkpoints: waited $((SECONDS - t0)) s here" ;;
    kv-tests)  # a KV cache shared on the GPU: a standby's captured graph replays on an adopted cache
      timeout 180 python3 -m pytest -q -p no:cacheprovider -rA -m gpu tests/engine/test_kvshare_gpu.py \
        2>&1 | tail -15 | tee "$OUT/tests_kv.txt" ;;
    standby-memory)  # device memory per engine process, KV cache private and shared (kv_adopt)
      checkpoint
      timeout "${MEMORY_S:-300}" python3 bench/standby_memory.py --policy chaos/scenarios/policy-gpu.yaml \
        --out "$OUT/standby_memory.json" 2>&1 | tail -20 | tee "$OUT/standby_memory.txt" ;;
    refit-tests)  # the refit's remap on cuda-vmm pools: a captured graph replays the new weights
      timeout 180 python3 -m pytest -q -p no:cacheprovider -rA -m gpu tests/cachedaemon/test_pool_refit.py \
        2>&1 | tail -15 | tee "$OUT/tests_refit.txt" ;;
    update-small)  # bench/update.py on the small preset (1.8 GB): the same steps, a short call
      for seed in 0 1; do [ -f /tmp/models/small-$seed/config.json ] || timeout 120 python3 -m \
        cachedaemon make-checkpoint /tmp/models/small-$seed --preset small --seed $seed | tail -1; done
      timeout "${UPDATE_S:-240}" python3 bench/update.py --policy chaos/scenarios/policy-gpu.yaml \
        --model-a /tmp/models/small-0 --model-b /tmp/models/small-1 --clients 16 --prompt 128 \
        --max-tokens 256 --standby 1 --no-batch --out "$OUT/update_small.json" > "$OUT/update_small.txt" 2>&1
      echo "update bench (small): exit $?"; tail -80 "$OUT/update_small.txt" ;;
    update)  # bench/update.py on llama-8b: an update to llama-8b-b, a refit back, a stop-and-start
      checkpoint
      t0=$SECONDS
      while [ ! -f /tmp/models/llama-8b-b/.complete ] && [ $((SECONDS - t0)) -lt 400 ]; do sleep 2; done
      echo "checkpoint b: after $((SECONDS - t0)) s here"; tail -2 /tmp/models/writer-b.log 2>/dev/null
      cat /tmp/models/llama-8b/*.safetensors > /dev/null  # the refit's new tensors: in host memory
      timeout "${UPDATE_S:-420}" python3 bench/update.py --policy chaos/scenarios/policy-gpu.yaml \
        --model-a /tmp/models/llama-8b --model-b /tmp/models/llama-8b-b --clients 16 --prompt 128 \
        --max-tokens 256 --standby 1 --no-batch ${UPDATE_ARGS:-} \
        --out "$OUT/update_llama-8b${UPDATE_TAG:+_$UPDATE_TAG}.json" \
        --logs "$RAW/update_logs${UPDATE_TAG:+_$UPDATE_TAG}" > "$OUT/update${UPDATE_TAG:+_$UPDATE_TAG}.txt" 2>&1
      echo "update bench: exit $?"; tail -80 "$OUT/update${UPDATE_TAG:+_$UPDATE_TAG}.txt" ;;
    load-digest)  # the daemon's llama-8b load with and without the content digest, interleaved
      checkpoint
      timeout 240 python3 bench/load_digest.py --preset llama-8b --models /tmp/models \
        --device cuda:0 --runs 3 --compare --label "$(git rev-parse --short HEAD 2>/dev/null)" \
        --out "$OUT/gpu_load_digest.json" 2>&1 | tail -40 | tee "$OUT/load_digest.txt"
      # the same with the 8 readers of before (in results.tgz)
      mkdir -p "$OUT/load_digest"
      for n in 8; do
        timeout 120 python3 bench/load_digest.py --preset llama-8b --models /tmp/models \
          --device cuda:0 --runs 3 --compare --readers $n --out "$OUT/load_digest/readers_$n.json" \
          2>&1 | tail -20 | tee -a "$OUT/load_digest.txt"
      done ;;
    checkpoint-bg)  # its own session: it outlives this call while the machine is held
      mkdir -p /tmp/models
      setsid nohup bash -c "$(declare -f write_checkpoint); CKPT_LOCK=$CKPT_LOCK write_checkpoint" \
        > /tmp/models/writer.log 2>&1 < /dev/null &
      echo "checkpoint: writing /tmp/models/llama-8b in the background (/tmp/models/writer.log)" ;;
    vllm-part) vllm_part ;;
    vllm) vllm_tree || { OUT=$OUT_GIVEN pack; exit 2; } ;;
    vllm-tiny)  # parity on the tiny Llama with a tokenizer (tests/vllm_checkpoints.py), bf16
      [ -f /tmp/models/tiny/llama/config.json ] || python3 -m tests.vllm_checkpoints /tmp/models/tiny
      timeout -k 20 "${VLLM_TINY_S:-240}" python3 bench/vllm_gpu.py --device cuda:0 \
        --model-dir /tmp/models/tiny/llama --stages parity --kv-cache-gb 1 --max-model-len 512 \
        --out "$OUT/vllm_gpu_tiny.json" --logs "$OUT/vllm_gpu_tiny_logs" 2>&1 | tee "$OUT/vllm_gpu_tiny.txt" ;;
    vllm-bench)  # the vLLM figures in one go, each stage kept as it ends
      checkpoint
      timeout -k 20 "${VLLM_BENCH_S:-470}" python3 bench/vllm_gpu.py --device cuda:0 \
        --model-dir /tmp/models/llama-8b --trials 2 --out "$OUT/vllm_gpu.json" \
        --logs "$OUT/vllm_gpu_logs" ${VLLM_BENCH_ARGS:-} 2>&1 | tee "$OUT/vllm_gpu.txt"
      python3 -c 'import json, sys; p = json.load(open(sys.argv[1]))["stages"].get("parity", {})
sys.exit(0 if p.get("equal") else 1)' "$OUT/vllm_gpu.json" && touch "$VLLM_HOME/parity-equal" ;;
    need-parity)  # go on only if an earlier call's vllm-bench saw equal tokens
      [ -f "$VLLM_HOME/parity-equal" ] || { echo "need-parity: no equal parity on this machine; stopping"; OUT=$OUT_GIVEN pack; exit 3; } ;;
    chaos) chaos_run gpu ;;
    chaos-tp2) chaos_run gpu-tp2 ;;
    scenario=*) f=${stage#scenario=}; chaos_run "$(basename "$f" .yaml)" "$f" ;;
    decode-profile)  # kernel by kernel: a decode step's GPU time, each projection's read rate
      timeout 400 python3 bench/decode_profile.py --preset llama-8b ${DECODE_PROFILE_ARGS:-} \
        --out "$OUT/decode_profile.json" 2>&1 | tail -150 | tee "$OUT/decode_profile.txt" ;;
    startup-profile)
      checkpoint
      timeout 300 python3 bench/startup_profile.py --model-dir /tmp/models/llama-8b --device cuda:0 \
        --trials 3 ${STARTUP_PROFILE_ARGS:---weights empty --whole --sort tottime} \
        --out "$OUT/startup_profile.json" 2>&1 | tail -120 | tee "$OUT/startup_profile.txt" ;;
    gpu-test=*) f=${stage#gpu-test=}
      timeout 300 python3 -m pytest -q -p no:cacheprovider -rA -m gpu "$f" 2>&1 | tail -15 \
        | tee "$OUT/tests_$(basename "$f" .py).txt" ;;
    lifetime)
      timeout 120 python3 bench/cuda_lifetime.py --model /tmp/models/moe --out "$OUT/h200_lifetime.json" \
        2>&1 | tee "$OUT/lifetime.txt" ;;
    *) echo "gpu_run.sh: no stage $stage (see the head of bench/gpu_run.sh)" ;;
  esac
  OUT=$OUT_GIVEN pack
done
