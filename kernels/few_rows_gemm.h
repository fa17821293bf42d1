#pragma once
// [Few-row GEMM]
// A layer's forward product for a request of a few tokens (a short inference request, or a
// 1-token call): out [M, N] = x [M, K] · Wᵀ for a row-major weight W [N, K] and M ≤ kFewRowsMax,
// in one kernel launch. Such a product reads the whole weight to produce a few values a row, so it
// is bound by the weight's bytes whichever kernel does it; what differs is the host's time to
// enqueue it, which on the executor's one scheduler thread is a 1-token call's largest part:
// cublasGemmEx 7.1–10.2 µs on an H200 under MPS, this kernel 3.4–4.8 µs
// (symbiosis-bench-roundtrip --primitives times both, and their GPU time). Each warp reads one row
// of W in 16-byte vectors, once for all M rows of x, and accumulates in fp32 like cuBLAS; the sum
// runs in another order, so results match cuBLAS's within the dtype's rounding, not bit for bit.
// fp32 products are full fp32 (never TF32). Built only with CUDA.
#include <ATen/ATen.h>

#include <cstdint>

#include "kernels/few_rows_gemm_launch.h"  // kFewRowsMax

namespace symbiosis::kernels {

// out = x · matrix on the current CUDA stream, for x [M, K] contiguous with M ≤ kFewRowsMax, matrix
// [K, N] the transpose of a contiguous W [N, K] (a Linear's forward operand), out [M, N]
// contiguous; x and W 16-byte aligned with rows of whole 16-byte vectors; all on one CUDA device
// in one dtype (fp32, bf16 or fp16). Returns false, doing nothing, for anything else.
bool few_rows_gemm(const at::Tensor& x, const at::Tensor& matrix, at::Tensor& out);

}  // namespace symbiosis::kernels
