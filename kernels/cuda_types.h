#pragma once
// [Torch-free kernels] (kernels/launch.h), the side that holds the tensors: ATen's element types as
// the CUDA types that the kernels' launch APIs take.
#include <ATen/ATen.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace symbiosis::kernels {

// The CUDA type of an ATen element type. c10::BFloat16 and __nv_bfloat16 are both a bfloat16's 16
// bits, c10::Half and __half an IEEE half's, so data pointers convert by reinterpret_cast.
template <typename T>
struct CudaTypeOf {
  using type = T;
};
template <>
struct CudaTypeOf<c10::BFloat16> {
  using type = __nv_bfloat16;
};
template <>
struct CudaTypeOf<c10::Half> {
  using type = __half;
};
template <typename T>
using cuda_type_t = typename CudaTypeOf<T>::type;
static_assert(sizeof(c10::BFloat16) == sizeof(__nv_bfloat16) && alignof(c10::BFloat16) == alignof(__nv_bfloat16));
static_assert(sizeof(c10::Half) == sizeof(__half) && alignof(c10::Half) == alignof(__half));

// t's elements, of ATen's type T, as T's CUDA type (data_ptr checks that t holds T).
template <typename T>
cuda_type_t<T>* cuda_data(const at::Tensor& t) {
  return reinterpret_cast<cuda_type_t<T>*>(t.data_ptr<T>());
}

// launch(T{}) for T the CUDA type of an fp32, bf16 or fp16 dtype; false, launching nothing, for any
// other dtype.
template <typename Launch>
bool with_cuda_type(at::ScalarType type, Launch&& launch) {
  switch (type) {
    case at::kFloat: launch(float{}); return true;
    case at::kBFloat16: launch(__nv_bfloat16{}); return true;
    case at::kHalf: launch(__half{}); return true;
    default: return false;
  }
}

}  // namespace symbiosis::kernels
