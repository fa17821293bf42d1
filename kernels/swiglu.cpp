// [Fused SwiGLU]: checks, allocation and dispatch; the kernels are in kernels/swiglu.cu ([Torch-free
// kernels] in kernels/launch.h).
#include "kernels/swiglu.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <utility>

#include "kernels/cuda_types.h"
#include "kernels/device_guard.h"
#include "kernels/swiglu_launch.h"

namespace symbiosis::kernels {
namespace {

template <typename T>
device::Matrix<T> matrix(const at::Tensor& t, const char* what) {
  const auto rows = t.view({-1, t.size(-1)});  // throws where the rows do not lie at one stride
  TORCH_CHECK(rows.stride(1) == 1 || rows.size(1) == 1, "swiglu: ", what, "'s last dimension must be contiguous");
  return {static_cast<T*>(rows.data_ptr()), rows.stride(0)};
}

void check(const at::Tensor& t, const at::Tensor& like, const char* what) {
  TORCH_CHECK(
      t.is_cuda() && t.sizes() == like.sizes() && t.scalar_type() == like.scalar_type() && t.device() == like.device(),
      "swiglu: ", what, " must be ", like.sizes(), " in ", like.scalar_type(), " on ", like.device(), ", got ",
      t.sizes(), " in ", t.scalar_type(), " on ", t.device());
}

}  // namespace

at::Tensor swiglu_forward(const at::Tensor& gate, const at::Tensor& up) {
  const auto device_guard = on_device_of(gate);  // [Operands' device]
  TORCH_CHECK(gate.is_cuda() && gate.dim() >= 1, "swiglu: gate must be a CUDA tensor, got ", gate.sizes(), " on ",
              gate.device());
  check(up, gate, "up");
  auto out = at::empty(gate.sizes(), gate.options());
  const int64_t n = gate.size(-1), elements = gate.numel();
  if (elements == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate.scalar_type(), "swiglu_forward", [&] {
    using T = cuda_type_t<scalar_t>;
    const auto g = matrix<const T>(gate, "gate"), u = matrix<const T>(up, "up");
    const auto o = matrix<T>(out, "out");
    C10_CUDA_CHECK(device::swiglu_forward<T>(g, u, o, n, elements, c10::cuda::getCurrentCUDAStream()));
  });
  return out;
}

void swiglu_backward(const at::Tensor& grad, const at::Tensor& gate, const at::Tensor& up, const at::Tensor& grad_gate,
                     const at::Tensor& grad_up) {
  const auto device_guard = on_device_of(gate);  // [Operands' device]
  TORCH_CHECK(gate.is_cuda() && gate.dim() >= 1, "swiglu: gate must be a CUDA tensor, got ", gate.sizes(), " on ",
              gate.device());
  for (const auto& [t, what] :
       {std::pair{&grad, "grad"}, {&up, "up"}, {&grad_gate, "grad_gate"}, {&grad_up, "grad_up"}}) {
    check(*t, gate, what);
  }
  const int64_t n = gate.size(-1), elements = gate.numel();
  if (elements == 0) return;
  const auto dy = grad.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate.scalar_type(), "swiglu_backward", [&] {
    using T = cuda_type_t<scalar_t>;
    const auto d = matrix<const T>(dy, "grad"), g = matrix<const T>(gate, "gate");
    const auto u = matrix<const T>(up, "up");
    const auto dg = matrix<T>(grad_gate, "grad_gate"), du = matrix<T>(grad_up, "grad_up");
    C10_CUDA_CHECK(device::swiglu_backward<T>(d, g, u, dg, du, n, elements, c10::cuda::getCurrentCUDAStream()));
  });
}

}  // namespace symbiosis::kernels
