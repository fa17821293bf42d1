#!/usr/bin/env bash
# On your own machine, after `make build`: copies what the GPU machine runs (the executor, the
# demo and benchmark clients, the benchmark programs, the GPU tests and our two shared libraries),
# stripped, into .gpu-build/ in the build tree's layout, so that the GPU machine needs no
# compiler time. They link against the same torch 2.11.0+cu130 wheel there; scripts/gpu_check.sh
# points the loader at that machine's copies and falls back to building from source when the
# bundle does not load. Pass carry: [".gpu", ".gpu-build"].
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BUILD_DIR=${BUILD_DIR:-build}
out=.gpu-build
rm -rf "$out"
for f in base_executor/symbiosis-executor examples/symbiosis-demo-client tools/symbiosis-make-checkpoint \
         tools/symbiosis-ctl bench/symbiosis-bench bench/symbiosis-bench-client bench/symbiosis-bench-roundtrip bench/symbiosis-bench-loss bench/symbiosis-bench-flag-handoff bench/symbiosis-bench-multi-lora \
         bench/symbiosis-soak bench/symbiosis-soak-client bench/symbiosis-bench-long-context bench/symbiosis-bench-shard-split \
         tests/base_executor/gpu_executor_test tests/kernels/kernels_test tests/transport/cuda_ipc/cuda_ipc_test tests/transport/nccl/nccl_test tests/transport/hostile_gpu_tenant tests/common/runtime_binding_test \
         tests/client_runtime/inference/gpu_generator_test tests/client_runtime/training/gpu_trainer_test tests/client_runtime/gpu_restart_test tests/privacy/gpu_privacy_test \
         examples/symbiosis-generate examples/symbiosis-finetune \
         client_runtime/libsymbiosis_client.so virt_layer/libsymbiosis_virt_layer.so; do
  mkdir -p "$out/$(dirname "$f")"
  strip --strip-debug -o "$out/$f" "$BUILD_DIR/$f"
done
# The Python programs' launchers ([Python programs' launchers] in python/CMakeLists.txt), run by the
# GPU machine's python3 (its PYTHONPATH finds the package).
for f in symbiosis-serve symbiosis-tinker; do
  [ -f "$BUILD_DIR/examples/$f" ] || continue
  sed '1s|.*|#!/usr/bin/env python3|' "$BUILD_DIR/examples/$f" > "$out/examples/$f" && chmod +x "$out/examples/$f"
done
# The Python package's extension module for the GPU machine's CPython (3.12; [Extension for another
# Python] in python/CMakeLists.txt: configure with -DSYMBIOSIS_BUNDLE_PYTHON=<a python3.12> and build
# symbiosis_python_extension_bundle). gpu_check.sh's Python stages put .gpu-build/python on PYTHONPATH
# and build it from source there when it is missing or does not import.
for f in "$BUILD_DIR"/python/symbiosis/_C.cpython-312-*.so; do
  [ -f "$f" ] || { echo "gpu_bundle: no $BUILD_DIR/python/symbiosis/_C.cpython-312-*.so: the GPU machine builds it (~1 min)"; continue; }
  mkdir -p "$out/python/symbiosis"
  strip --strip-debug -o "$out/python/symbiosis/$(basename "$f")" "$f"
done
# [GPU suites in ctest]: the carried GPU suites' ctest entries (what gtest_discover_tests wrote, label
# gpu), the build tree's path left as @BUILD@ for gpu_check.sh to fill in where the bundle lands;
# there `ctest --test-dir .gpu-build -L gpu` runs them.
build_path=$(cd "$BUILD_DIR" && pwd)
: > "$out/CTestTestfile.cmake.in"
for f in $(cd "$BUILD_DIR" && grep -rl --include='*_tests.cmake' 'LABELS gpu' tests | sort); do
  [ -f "$out/${f%\[1\]_tests.cmake}" ] || continue  # a suite not carried
  sed "s|$build_path|@BUILD@|g" "$BUILD_DIR/$f" > "$out/$f.in"
  echo "include(\"@BUILD@/$f\")" >> "$out/CTestTestfile.cmake.in"
done
git rev-parse HEAD > "$out/COMMIT"
git diff --stat HEAD > "$out/DIFF" || true
echo "bundled $(du -sh "$out" | cut -f1) into $out"
