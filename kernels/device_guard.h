#pragma once
// [Operands' device]
// A kernel launches on the current device and its stream, which in a process whose tensors live
// on another GPU than the first (a tenant on cuda:1 beside an executor on cuda:0, say) is not
// theirs: every entry point here that launches work first makes the operands' device current for
// its scope.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>

#include <optional>

namespace symbiosis::kernels {

// The guard of `t`'s device, for its scope; none for a tensor not on a GPU.
inline c10::cuda::OptionalCUDAGuard on_device_of(const at::Tensor& t) {
  return c10::cuda::OptionalCUDAGuard(t.defined() && t.is_cuda() ? std::make_optional(t.device()) : std::nullopt);
}

}  // namespace symbiosis::kernels
