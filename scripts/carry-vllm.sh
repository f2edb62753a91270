#!/usr/bin/env bash
# Build a CUDA vLLM for the GPU machine as a pruned site-packages tree, packed and cut into
# parts small enough to travel beside the working tree, one part a call:
#   scripts/carry-vllm.sh [--part-mb N]      -> .vllm/part-00/ .. part-NN/ (a part, its sha256, the count)
# On the GPU machine, `bench/gpu_run.sh vllm-part` keeps each part it is sent (in
# /tmp/holdfast-vllm-cuda/parts, which lasts while the machine stays in use), and any stage
# after `vllm` (which reassembles the tree once every part is there) runs with it.
# See docs/gpu.md ("vLLM on the GPU").
#
# The wheels (scripts/vllm-gpu-wheels.txt: cp312, manylinux) are cached in
# $HOLDFAST_CARRY_CACHE (default ~/.cache/holdfast-carry). What is pruned from vLLM, and why:
#   vllm_flash_attn/_vllm_fa2_C*.so   FlashAttention 2 (290 MB); Hopper runs FlashAttention 3
#   _moe_C_stable_libtorch*.so        MoE kernels only (45 MB); vLLM ignores its absence
#   vllm-rs                           only with VLLM_USE_RUST_FRONTEND (41 MB)
#   deep_gemm _C builds for CPython other than 3.12, and the C++ header trees that only a
#   JIT build of deep_gemm / fmha_sm100 would read
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
part_mb=""
case "${1:-}" in
  --part-mb) part_mb=${2:?--part-mb needs a number of MiB} ;;
  "") ;;
  *) echo "usage: scripts/carry-vllm.sh [--part-mb N]" >&2; exit 2 ;;
esac
cache=${HOLDFAST_CARRY_CACHE:-$HOME/.cache/holdfast-carry}
wheels=$cache/wheels tree=$cache/tree out=$root/.vllm
mkdir -p "$wheels"
platforms=()
for n in 5 17 27 28 31 34 35 39; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
reqs=$(grep -v '^\s*#' scripts/vllm-gpu-wheels.txt | sed 's/#.*//' | awk 'NF {print $1}')

echo "== wheels ($wheels)"
# shellcheck disable=SC2086  # one requirement a word
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d "$wheels" $reqs
for req in $reqs; do  # exactly one wheel of each, at the pinned version
  name=$(echo "${req%%==*}" | tr '[:upper:]-.' '[:lower:]__') version=${req##*==}
  found=$(find "$wheels" -maxdepth 1 -iname "${name}-${version}-*.whl" | wc -l)
  [ "$found" = 1 ] || { echo "carry-vllm.sh: $found wheels of $req in $wheels" >&2; exit 1; }
done

# what the packed tree is made of: a second run with the same packs nothing again
key=$(cat scripts/carry-vllm.sh scripts/vllm-gpu-wheels.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -f "$cache/vllm-tree.tar.xz" ] && [ "$(cat "$cache/vllm-tree.key" 2>/dev/null)" = "$key" ]; then
  echo "== tree: packed already ($cache/vllm-tree.tar.xz)"
else
rm -f "$cache/vllm-tree.key"
echo "== tree ($tree)"
rm -rf "$tree"; mkdir -p "$tree"
files=()
for req in $reqs; do
  name=$(echo "${req%%==*}" | tr '[:upper:]-.' '[:lower:]__') version=${req##*==}
  files+=("$(find "$wheels" -maxdepth 1 -iname "${name}-${version}-*.whl")")
done
python3 -m pip install -q --no-index --no-deps --no-compile --only-binary=:all: \
  --python-version 3.12 --implementation cp "${platforms[@]}" --target "$tree" "${files[@]}"
rm -rf "$tree/bin" \
  "$tree"/vllm/vllm_flash_attn/_vllm_fa2_C*.so \
  "$tree"/vllm/_moe_C_stable_libtorch*.so \
  "$tree/vllm/vllm-rs" \
  "$tree/vllm/third_party/deep_gemm/include" \
  "$tree/vllm/third_party/fmha_sm100/cutlass"
find "$tree" -path '*deep_gemm*' -name '_C.cpython-*.so' ! -name '*cpython-312*' -delete
find "$tree" -name __pycache__ -type d -prune -exec rm -rf {} +
# the loader plugin's entry point: vLLM finds holdfast_vllm (from the checkout, on
# PYTHONPATH there) without pip-installing the project
plugin=$tree/holdfast_vllm_plugin-0.dist-info
mkdir -p "$plugin"
printf 'Metadata-Version: 2.1\nName: holdfast-vllm-plugin\nVersion: 0\n' > "$plugin/METADATA"
sed -n '/^\[project.entry-points."vllm.general_plugins"\]/,/^$/p' pyproject.toml \
  | sed '1s/.*/[vllm.general_plugins]/; s/"//g' > "$plugin/entry_points.txt"
grep -q '^holdfast = ' "$plugin/entry_points.txt" ||
  { echo "carry-vllm.sh: pyproject.toml names no vllm.general_plugins entry" >&2; exit 1; }
echo "tree: $(du -sh "$tree" | cut -f1)"
tar -C "$tree" -cf - . | xz -9 -T0 > "$cache/vllm-tree.tar.xz"
echo "$key" > "$cache/vllm-tree.key"
fi

echo "== parts ($out)"
if [ -z "$part_mb" ]; then  # what travels besides a part: the working tree, which counts too
  tree_bytes=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null \
    | awk '{s += $1} END {print s + 0}')
  part_mb=$(( 62 - tree_bytes / 1048576 ))
fi
[ "$part_mb" -ge 4 ] || { echo "carry-vllm.sh: only ${part_mb} MiB would be left a part beside the working tree; pass --part-mb" >&2; exit 1; }
rm -rf "$out" "$cache"/part.*; mkdir -p "$out"
split -b "${part_mb}M" -d "$cache/vllm-tree.tar.xz" "$cache/part."
count=$(ls "$cache"/part.* | wc -l)
for part in "$cache"/part.*; do  # one folder a part, each with the checksum and the count
  dir=$out/$(basename "$part" | tr . -)
  mkdir -p "$dir"; mv "$part" "$dir/"
  (cd "$cache" && sha256sum vllm-tree.tar.xz) > "$dir/SHA256SUMS"
  echo "$count" > "$dir/COUNT"
done
echo "$count parts of at most ${part_mb} MiB ($(du -sh "$cache/vllm-tree.tar.xz" | cut -f1) packed):"
ls -1d "$out"/part-*
cat <<MSG
Send them in order, one call each, each right after the last (the machine keeps them only
while it is in use), carrying one folder a call:
  carry .vllm/part-00, command: bash bench/gpu_run.sh vllm-part
  ...
  carry .vllm/part-NN (the last), command: bash bench/gpu_run.sh vllm-part vllm STAGES...
MSG
