#pragma once
// [Few-row GEMM]'s kernel, without LibTorch ([Torch-free kernels] in kernels/launch.h); callers use
// kernels/few_rows_gemm.h.
#include <cstdint>

#include "kernels/launch.h"

namespace symbiosis::kernels {

// Up to here the kernel's GPU time is about cuBLAS's (H200, [2048, 2048] bf16: 4.4, 5.5 and 6.4 µs
// for 1, 2 and 4 rows against cuBLAS's 6.0); at 8 rows it took 10.2, so more rows go to cuBLAS.
constexpr int64_t kFewRowsMax = 4;

namespace device {

// out [rows, n] = x [rows, k] · weightᵀ for a row-major weight [n, k], on `stream`: 1 ≤ rows ≤
// kFewRowsMax, x and weight 16-byte aligned with rows of whole 16-byte vectors, all contiguous.
template <typename T>
cudaError_t few_rows_gemm(const T* x, const T* weight, T* out, int rows, int64_t n, int64_t k, cudaStream_t stream);

}  // namespace device
}  // namespace symbiosis::kernels
