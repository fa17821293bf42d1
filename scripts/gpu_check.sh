#!/usr/bin/env bash
# On the GPU machine (see ../shared/gpu/README.md): runs the GPU tests and benchmarks of the
# stages named as arguments, leaving every log and result under $OUT. Start it as
#   source .gpu/env.sh && bash scripts/gpu_check.sh tests roundtrip ...
# with carry: [".gpu", ".gpu-build"]. It uses the binaries that scripts/gpu_bundle.sh carried in
# .gpu-build when they load here, and builds from source into build-gpu otherwise.
# Each stage is a file of scripts/gpu_stages/ (its head says what it runs and the settings it reads),
# sourced here with the helpers of scripts/gpu_stages/lib.sh; `bash scripts/gpu_check.sh list` prints
# them all.
if [ "${1:-}" = list ]; then
  for f in "$(dirname "$0")"/gpu_stages/*.sh; do
    [ "$(basename "$f")" = lib.sh ] || sed -n "/^# stages:/,/^[^#]/p" "$f" | sed "\$d"
  done
  exit 0
fi
set -uo pipefail
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
root=$(pwd)
start=$(date +%s)
log() { echo "[gpu_check $(( $(date +%s) - start ))s] $*"; }
log "$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tr '\n' ';')"

# The loader finds this machine's torch, CUDA libraries and NCCL (the wheel's), then ours.
site=$(python3 -c 'import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))')
nv=""
for d in "$site"/nvidia/*/lib; do nv="$nv:$d"; done
export LD_LIBRARY_PATH="$site/torch/lib$nv:${LD_LIBRARY_PATH:-}"
B=$root/.gpu-build
if [ -x "$B/base_executor/symbiosis-executor" ] && \
   LD_LIBRARY_PATH="$B/client_runtime:$B/virt_layer:$LD_LIBRARY_PATH" "$B/base_executor/symbiosis-executor" --help > /dev/null 2>&1; then
  export LD_LIBRARY_PATH="$B/client_runtime:$B/virt_layer:$LD_LIBRARY_PATH"
  log "using the carried build ($(cat "$B/COMMIT" 2>/dev/null))"
  # [GPU suites in ctest] (scripts/gpu_bundle.sh): the carried ctest entries, pointed at this tree.
  # A suite trimmed from the bundle after it was made (its binary gone) is left out.
  for f in $(cd "$B" && find . -name '*_tests.cmake.in'); do
    [ -f "$B/${f%\[1\]_tests.cmake.in}" ] && sed "s|@BUILD@|$B|g" "$B/$f" > "$B/${f%.in}"
  done
  while read -r line; do
    f=$(sed -n 's|include("@BUILD@/\(.*\)")|\1|p' <<< "$line")
    [ -f "$B/$f" ] && echo "include(\"$B/$f\")"
  done < "$B/CTestTestfile.cmake.in" > "$B/CTestTestfile.cmake"
else
  log "carried build does not load here; building from source"
  LD_LIBRARY_PATH="$B/client_runtime:$B/virt_layer:$LD_LIBRARY_PATH" ldd "$B/base_executor/symbiosis-executor" 2>&1 | grep "not found" | head
  B=$root/build-gpu
  cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSYMBIOSIS_PYTHON=python3 > "$out/configure.log" 2>&1 \
    || { tail -30 "$out/configure.log"; exit 1; }
  cmake --build "$B" --target symbiosis-executor symbiosis-demo-client symbiosis-make-checkpoint symbiosis-bench \
    symbiosis-bench-client symbiosis-bench-roundtrip symbiosis-bench-loss symbiosis-soak symbiosis-soak-client gpu_executor_test kernels_test cuda_ipc_test nccl_test hostile_gpu_tenant runtime_binding_test \
    gpu_generator_test gpu_trainer_test gpu_privacy_test symbiosis-finetune symbiosis-generate symbiosis-bench-long-context \
    > "$out/build.log" 2>&1 \
    || { grep -B2 -A8 -m3 "error" "$out/build.log"; exit 1; }
  export LD_LIBRARY_PATH="$B/client_runtime:$B/virt_layer:$LD_LIBRARY_PATH"
  log "built"
fi
gpus=$(nvidia-smi -L | wc -l)
source "$root/scripts/gpu_stages/lib.sh"

for stage in "$@"; do
  log "stage $stage"
  file=$(grep -lE "^# stages:( [a-z0-9-]+)* $stage( |\$)" "$root"/scripts/gpu_stages/*.sh | head -1)
  if [ -n "$file" ]; then
    source "$file"
  else
    log "unknown stage $stage (bash scripts/gpu_check.sh list)"
  fi
done
log "done"
