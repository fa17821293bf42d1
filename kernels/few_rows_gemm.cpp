// [Few-row GEMM]: the operands' checks and dispatch; the kernel is in kernels/few_rows_gemm.cu
// ([Torch-free kernels] in kernels/launch.h).
#include "kernels/few_rows_gemm.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/cuda_types.h"
#include "kernels/device_guard.h"
#include "kernels/few_rows_gemm_launch.h"
#include "kernels/gemm_operands.h"

namespace symbiosis::kernels {
namespace {

// Rows of `k` elements of this size, starting at `data`, are whole 16-byte vectors.
bool whole_vectors(const void* data, int64_t k, int64_t element_size) {
  return reinterpret_cast<uintptr_t>(data) % 16 == 0 && (k * element_size) % 16 == 0;
}

}  // namespace

bool few_rows_gemm(const at::Tensor& x, const at::Tensor& matrix, at::Tensor& out) {
  const auto device_guard = on_device_of(x);  // [Operands' device]
  if (!gemm_operands(x, matrix, out)) return false;
  const int64_t m = x.size(0), k = x.size(1), n = matrix.size(1);
  if (m < 1 || m > kFewRowsMax || n < 1) return false;
  // matrix is Wᵀ for a row-major W [n, k]: its rows are W's columns, one stride apart.
  if (matrix.stride(0) != 1 || matrix.stride(1) != k) return false;
  const auto element = x.element_size();
  if (!whole_vectors(x.data_ptr(), k, element) || !whole_vectors(matrix.data_ptr(), k, element)) return false;
  // gemm_operands took the dtype.
  with_cuda_type(x.scalar_type(), [&](auto type) {
    using T = decltype(type);
    C10_CUDA_CHECK(device::few_rows_gemm(static_cast<const T*>(x.data_ptr()), static_cast<const T*>(matrix.data_ptr()),
                                         static_cast<T*>(out.data_ptr()), static_cast<int>(m), n, k,
                                         c10::cuda::getCurrentCUDAStream()));
  });
  return true;
}

}  // namespace symbiosis::kernels
