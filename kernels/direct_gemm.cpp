#include "kernels/direct_gemm.h"

#include <ATen/Context.h>
#include <c10/cuda/CUDAStream.h>
#include <cublas_v2.h>

#include <algorithm>
#include <memory>
#include <unordered_map>

#include "common/cuda_check.h"
#include "kernels/device_guard.h"
#include "kernels/few_rows_gemm.h"
#include "kernels/gemm_operands.h"

namespace symbiosis::cuda {
namespace {

thread_local int sm_percent = 100;  // [Fine-tuning's SMs]: this thread's GemmSmTarget

// One handle per thread and stream, made on first use: a cuBLAS handle is not shared between
// threads, and GEMMs of one handle running at once on two streams would share its workspace.
struct Handle {
  cublasHandle_t handle = nullptr;
  int sms = 0;        // the stream's device's multiprocessors
  int sm_target = 0;  // as last set ([Fine-tuning's SMs])
  explicit Handle(cudaStream_t stream) {
    SYMBIOSIS_CUBLAS_CHECK(cublasCreate(&handle));
    SYMBIOSIS_CUBLAS_CHECK(cublasSetStream(handle, stream));
    int device = 0;
    SYMBIOSIS_CUDA_CHECK(cudaGetDevice(&device));
    SYMBIOSIS_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  }
  ~Handle() { SYMBIOSIS_CUBLAS_WARN(cublasDestroy(handle)); }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  // cuBLAS's SM count target for sm_percent of the multiprocessors (0: all).
  void target_sms() {
    const int target = sm_percent >= 100 ? 0 : std::max(1, sms * sm_percent / 100);
    if (target == sm_target) return;
    SYMBIOSIS_CUBLAS_CHECK(cublasSetSmCountTarget(handle, target));
    sm_target = target;
  }
};

cublasHandle_t handle_for(cudaStream_t stream) {
  static thread_local std::unordered_map<cudaStream_t, std::unique_ptr<Handle>> handles;
  auto& h = handles[stream];
  if (!h) h = std::make_unique<Handle>(stream);
  h->target_sms();
  return h->handle;
}

cudaDataType_t data_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return CUDA_R_32F;
    case at::kBFloat16: return CUDA_R_16BF;
    default: return CUDA_R_16F;
  }
}

}  // namespace

GemmSmTarget::GemmSmTarget(int percent) : previous_(sm_percent) { sm_percent = percent; }
GemmSmTarget::~GemmSmTarget() { sm_percent = previous_; }

bool gemm_into(const at::Tensor& x, const at::Tensor& matrix, at::Tensor& out) {
  const auto device_guard = kernels::on_device_of(x);  // [Operands' device]
  // Most calls carry many tokens: they skip the few-row kernel's checks.
  if (x.dim() == 2 && x.size(0) <= kernels::kFewRowsMax && kernels::few_rows_gemm(x, matrix, out)) return true;
  return cublas_gemm_into(x, matrix, out);
}

bool cublas_gemm_into(const at::Tensor& x, const at::Tensor& matrix, at::Tensor& out) {
  if (!kernels::gemm_operands(x, matrix, out)) return false;
  const auto type = x.scalar_type();
  const int64_t m = x.size(0), k = x.size(1), n = matrix.size(1);
  // Column-major, as cuBLAS counts: outᵀ [n, m] = matrixᵀ · xᵀ, where x's rows are xᵀ's columns.
  cublasOperation_t op;
  int64_t ld;
  if (matrix.stride(1) == 1 && matrix.stride(0) == n) {  // [k, n] row-major: its memory is matrixᵀ
    op = CUBLAS_OP_N;
    ld = n;
  } else if (matrix.stride(0) == 1 && matrix.stride(1) == k) {  // the transpose of a row-major [n, k]
    op = CUBLAS_OP_T;
    ld = k;
  } else {
    return false;
  }
  cublasHandle_t handle = handle_for(c10::cuda::getCurrentCUDAStream(x.device().index()).stream());
  auto& context = at::globalContext();
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  cublasMath_t math = CUBLAS_DEFAULT_MATH;
  if (type == at::kFloat && context.allowTF32CuBLAS()) compute = CUBLAS_COMPUTE_32F_FAST_TF32;
  constexpr auto allowed = at::CuBLASReductionOption::AllowReducedPrecisionWithSplitK;
  if ((type == at::kBFloat16 && context.allowBF16ReductionCuBLAS() != allowed) ||
      (type == at::kHalf && context.allowFP16ReductionCuBLAS() != allowed)) {
    math = CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION;
  }
  SYMBIOSIS_CUBLAS_CHECK(cublasSetMathMode(handle, math));
  const float alpha = 1.0f, beta = 0.0f;
  const auto dt = data_type(type);
  SYMBIOSIS_CUBLAS_CHECK(cublasGemmEx(handle, op, CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(m),
                                      static_cast<int>(k), &alpha, matrix.data_ptr(), dt, static_cast<int>(ld),
                                      x.data_ptr(), dt, static_cast<int>(k), &beta, out.data_ptr(), dt,
                                      static_cast<int>(n), compute, CUBLAS_GEMM_DEFAULT));
  return true;
}

}  // namespace symbiosis::cuda
