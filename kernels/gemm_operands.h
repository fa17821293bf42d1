#pragma once
// What both of the executor's GEMM paths take, [Direct cuBLAS] (direct_gemm.h) and [Few-row GEMM]
// (few_rows_gemm.h), before each looks at the layout it needs.
#include <ATen/ATen.h>

namespace symbiosis::kernels {

// x [M, K] and out [M, N] contiguous, matrix [K, N] of any strides; all 2-D, on one CUDA device,
// in one dtype of fp32, bf16 and fp16.
inline bool gemm_operands(const at::Tensor& x, const at::Tensor& matrix, const at::Tensor& out) {
  const auto type = x.scalar_type();
  if (type != at::kFloat && type != at::kBFloat16 && type != at::kHalf) return false;
  if (matrix.scalar_type() != type || out.scalar_type() != type) return false;
  if (!x.is_cuda() || matrix.device() != x.device() || out.device() != x.device()) return false;
  if (x.dim() != 2 || matrix.dim() != 2 || out.dim() != 2) return false;
  if (!x.is_contiguous() || !out.is_contiguous()) return false;
  return matrix.size(0) == x.size(1) && out.size(0) == x.size(0) && out.size(1) == matrix.size(1);
}

}  // namespace symbiosis::kernels
