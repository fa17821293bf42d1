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
         tools/symbiosis-ctl bench/symbiosis-bench bench/symbiosis-bench-client bench/symbiosis-bench-roundtrip bench/symbiosis-bench-loss \
         bench/symbiosis-soak bench/symbiosis-soak-client bench/symbiosis-bench-long-context \
         tests/base_executor/gpu_executor_test tests/kernels/kernels_test tests/transport/cuda_ipc/cuda_ipc_test tests/transport/nccl/nccl_test tests/common/runtime_binding_test \
         tests/client_runtime/inference/gpu_generator_test tests/client_runtime/training/gpu_trainer_test tests/client_runtime/gpu_restart_test tests/privacy/gpu_privacy_test \
         examples/symbiosis-generate examples/symbiosis-finetune \
         client_runtime/libsymbiosis_client.so client_runtime/libsymbiosis_sentencepiece.so virt_layer/libsymbiosis_virt_layer.so; do
  mkdir -p "$out/$(dirname "$f")"
  strip --strip-debug -o "$out/$f" "$BUILD_DIR/$f"
done
# The GPU machine lacks SentencePiece: its library goes beside ours, which load it from the library path
# ([SentencePiece apart] in client_runtime/text/sentencepiece_backend.h).
cp -L "$(gcc -print-file-name=libsentencepiece.so.0)" "$out/client_runtime/libsentencepiece.so.0"
git rev-parse HEAD > "$out/COMMIT"
git diff --stat HEAD > "$out/DIFF" || true
echo "bundled $(du -sh "$out" | cut -f1) into $out"
