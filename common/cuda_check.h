#pragma once
// One checking macro each for the CUDA runtime and driver, cuBLAS and NCCL (c10d's
// C10D_NCCL_CHECK, ggml's CUDA_CHECK): a failed call throws a c10::Error naming the file, the line,
// the call and the library's own error string. Destructors, which must not throw, use the _WARN
// forms, which log the same and go on. Include the library's header before this one.
#include <c10/util/Exception.h>
#include <c10/util/Logging.h>

#define SYMBIOSIS_LIBRARY_CHECK_(status_type, ok, error_string, call)            \
  do {                                                                           \
    const status_type symbiosis_status_ = (call);                                \
    TORCH_CHECK(symbiosis_status_ == (ok), __FILE__, ":", __LINE__, ": ", #call, \
                " failed: ", error_string(symbiosis_status_));                   \
  } while (0)
#define SYMBIOSIS_LIBRARY_WARN_(status_type, ok, error_string, call)                                                  \
  do {                                                                                                                \
    const status_type symbiosis_status_ = (call);                                                                     \
    if (symbiosis_status_ != (ok)) {                                                                                  \
      LOG(WARNING) << __FILE__ << ":" << __LINE__ << ": " << #call << " failed: " << error_string(symbiosis_status_); \
    }                                                                                                                 \
  } while (0)

// The driver API names its errors through an out-parameter.
#define SYMBIOSIS_CU_ERROR_STRING_(status)                                                          \
  ([](CUresult s) {                                                                                 \
    const char* text = nullptr;                                                                     \
    return cuGetErrorString(s, &text) == CUDA_SUCCESS && text ? text : "unknown CUDA driver error"; \
  }(status))

#define SYMBIOSIS_CUDA_CHECK(call) SYMBIOSIS_LIBRARY_CHECK_(cudaError_t, cudaSuccess, cudaGetErrorString, call)
#define SYMBIOSIS_CUDA_WARN(call) SYMBIOSIS_LIBRARY_WARN_(cudaError_t, cudaSuccess, cudaGetErrorString, call)
#define SYMBIOSIS_CU_CHECK(call) SYMBIOSIS_LIBRARY_CHECK_(CUresult, CUDA_SUCCESS, SYMBIOSIS_CU_ERROR_STRING_, call)
#define SYMBIOSIS_CUBLAS_CHECK(call) \
  SYMBIOSIS_LIBRARY_CHECK_(cublasStatus_t, CUBLAS_STATUS_SUCCESS, cublasGetStatusString, call)
#define SYMBIOSIS_CUBLAS_WARN(call) \
  SYMBIOSIS_LIBRARY_WARN_(cublasStatus_t, CUBLAS_STATUS_SUCCESS, cublasGetStatusString, call)
#define SYMBIOSIS_NCCL_CHECK(call) SYMBIOSIS_LIBRARY_CHECK_(ncclResult_t, ncclSuccess, ncclGetErrorString, call)
#define SYMBIOSIS_NCCL_WARN(call) SYMBIOSIS_LIBRARY_WARN_(ncclResult_t, ncclSuccess, ncclGetErrorString, call)
