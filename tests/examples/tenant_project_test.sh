#!/usr/bin/env bash
# The installed client package builds a tenant's own CMake project, and that program trains a
# LoRA adapter against a running executor; the executor and the tenant tools are installed too.
# Usage: tenant_project_test.sh SOURCE_DIR BINARY_DIR TORCH_CMAKE_PREFIX
set -euo pipefail
src=$1 bin=$2 torch_prefix=$3
work=$(mktemp -d /tmp/symbiosis-tenant-XXXXXX)
executor_pid=""
trap '[ -n "$executor_pid" ] && kill $executor_pid 2>/dev/null; rm -rf "$work"' EXIT

cmake --install "$bin" --prefix "$work/prefix" > "$work/install.log"
test -f "$work/prefix/lib/cmake/Symbiosis/SymbiosisConfig.cmake"
# The tools are installed, and run from the prefix (their libraries found without LD_LIBRARY_PATH).
for tool in symbiosis-executor symbiosis-ctl symbiosis-make-checkpoint symbiosis-finetune symbiosis-generate; do
  test -x "$work/prefix/bin/$tool" || { echo "cmake --install did not install bin/$tool"; exit 1; }
  env -u LD_LIBRARY_PATH "$work/prefix/bin/$tool" --help > "$work/$tool.help" ||
    { echo "installed $tool --help failed:"; cat "$work/$tool.help"; exit 1; }
  grep -q "$tool" "$work/$tool.help" || { echo "installed $tool --help does not name it:"; cat "$work/$tool.help"; exit 1; }
done
cmake -S "$src/examples/tenant_project" -B "$work/build" -G Ninja \
  -DCMAKE_PREFIX_PATH="$work/prefix;$torch_prefix" > "$work/configure.log" || { cat "$work/configure.log"; exit 1; }
cmake --build "$work/build" > "$work/build.log" || { cat "$work/build.log"; exit 1; }

"$work/prefix/bin/symbiosis-make-checkpoint" --preset tiny-llama --out "$work/model" > /dev/null
"$work/prefix/bin/symbiosis-executor" --model "$work/model" --listen 'tcp://127.0.0.1:*' > "$work/executor.out" 2>/dev/null &
executor_pid=$!
for _ in $(seq 100); do grep -q '^ready ' "$work/executor.out" && break; sleep 0.1; done
endpoint=$(sed -n 's/^ready //p' "$work/executor.out")
"$work/build/tenant_finetune" "$endpoint" "$work/model" "$work/adapter"
test -f "$work/adapter/adapter_model.safetensors"
echo "tenant project built against the installed package and trained an adapter"
