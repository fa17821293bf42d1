#pragma once
// [Direct cuBLAS]
// The executor's GEMM without ATen's dispatch. Enqueueing a 1-token product is most of a layer
// call's host time on the executor, whose one scheduler thread serves every client, so that time
// bounds how many calls a second it takes. Measured on an H200 (symbiosis-bench-roundtrip
// --primitives): at::mm_out 9.5–14.2 µs, cublasGemmEx called directly 8.0–11.6 µs. gemm_into
// enqueues the same cublasGemmEx that ATen reaches (fp32 accumulation; TF32 and reduced-precision
// reductions as ATen's global settings say) through a cuBLAS handle of the calling thread's own
// for its current stream. A forward product of a few tokens goes to a kernel of our own instead
// ([Few-row GEMM] in kernels/few_rows_gemm.h), which takes less host time to enqueue.
#include <ATen/ATen.h>

namespace symbiosis::cuda {

// out = x · matrix for x [M, K] contiguous, matrix [K, N] contiguous or the transpose of a
// contiguous [N, K], out [M, N] contiguous, all on one CUDA device (the current one) in one dtype
// (fp32, bf16 or fp16). Returns false, doing nothing, for anything else (the caller then uses ATen).
// Few rows of x times a Linear's forward operand: [Few-row GEMM]; anything else: cuBLAS.
bool gemm_into(const at::Tensor& x, const at::Tensor& matrix, at::Tensor& out);
// The same, always through cublasGemmEx.
bool cublas_gemm_into(const at::Tensor& x, const at::Tensor& matrix, at::Tensor& out);

// [Fine-tuning's SMs]
// A large GEMM's kernel on Hopper keeps one block on every multiprocessor until the product is
// done, so a decode call that comes meanwhile waits for it whatever its stream's priority. While a
// GemmSmTarget lives on a thread, the cuBLAS GEMMs that thread enqueues are sized for `percent` of
// the current GPU's multiprocessors (cublasSetSmCountTarget; 100: all of them), leaving the rest to
// other streams. A graph recorded of such GEMMs keeps the target it was recorded with, so a
// replayed call is recorded once for each target it comes under (Channel::compute_replayed's
// variant): before, a call recorded before any tenant decoded kept all the SMs while one did.
class GemmSmTarget {
 public:
  explicit GemmSmTarget(int percent);
  ~GemmSmTarget();
  GemmSmTarget(const GemmSmTarget&) = delete;
  GemmSmTarget& operator=(const GemmSmTarget&) = delete;

 private:
  int previous_;
};

}  // namespace symbiosis::cuda
