#pragma once
// [Direct cuBLAS]
// The executor's GEMM without ATen's dispatch: measured on an H200 (symbiosis-bench-roundtrip
// --primitives), at::mm takes 9–17 µs of host time to enqueue a 1-token product, most of a layer
// call's cost on the executor, and the executor's one compute thread serves every client, so that
// time bounds how many calls a second it can take. gemm_into enqueues the same cublasGemmEx that
// ATen reaches (fp32 accumulation; TF32 and reduced-precision reductions as ATen's global settings
// say) through a cuBLAS handle of the calling thread's own for its current stream.
#include <ATen/ATen.h>

namespace symbiosis::cuda {

// out = x · matrix for x [M, K] contiguous, matrix [K, N] contiguous or the transpose of a
// contiguous [N, K], out [M, N] contiguous, all on the current CUDA device in one dtype (fp32,
// bf16 or fp16). Returns false, doing nothing, for anything else (the caller then uses ATen).
bool gemm_into(const at::Tensor& x, const at::Tensor& matrix, at::Tensor& out);

}  // namespace symbiosis::cuda
