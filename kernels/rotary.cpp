// [Fused rotary embedding]: checks, allocation and dispatch; the kernel is in kernels/rotary.cu
// ([Torch-free kernels] in kernels/launch.h).
#include "kernels/rotary.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/cuda_types.h"
#include "kernels/device_guard.h"
#include "kernels/rotary_launch.h"

namespace symbiosis::kernels {
namespace {

device::RotaryRows rows_of(const at::Tensor& t, int64_t heads, int64_t tokens) {
  return {heads, tokens, t.size(0) == 1 ? 0 : t.stride(0), t.size(1) == 1 ? 0 : t.stride(1), t.stride(2)};
}

}  // namespace

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool backward) {
  const auto device_guard = on_device_of(x);  // [Operands' device]
  TORCH_CHECK(x.is_cuda() && x.dim() == 4 && x.stride(3) == 1 && x.size(3) % 2 == 0,
              "rotary: x must be a [batch, heads, tokens, dim] CUDA tensor with the last dimension contiguous and "
              "even, got ",
              x.sizes(), " with strides ", x.strides(), " on ", x.device());
  for (const auto* angles : {&cos, &sin}) {
    TORCH_CHECK(angles->dim() == 4 && (angles->size(0) == 1 || angles->size(0) == x.size(0)) && angles->size(1) == 1 &&
                    angles->size(2) == x.size(2) && angles->size(3) == x.size(3) && angles->stride(3) == 1 &&
                    angles->scalar_type() == x.scalar_type() && angles->device() == x.device(),
                "rotary: cos and sin must be [", x.size(0), " or 1, 1, ", x.size(2), ", ", x.size(3), "] in ",
                x.scalar_type(), " on ", x.device(), " with the last dimension contiguous, got ", angles->sizes(),
                " in ", angles->scalar_type());
  }
  TORCH_CHECK(cos.strides() == sin.strides(), "rotary: cos and sin must be laid out alike");
  auto out = at::empty_like(x);  // laid out as x, when x is dense
  if (out.stride(3) != 1) out = at::empty(x.sizes(), x.options());
  const int64_t heads = x.size(1), tokens = x.size(2), half = x.size(3) / 2;
  const int64_t pairs = x.size(0) * heads * tokens * half;
  if (pairs == 0) return out;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const auto x_rows = rows_of(x, heads, tokens), out_rows = rows_of(out, heads, tokens);
  const auto angle_rows = rows_of(cos, heads, tokens);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary", [&] {
    C10_CUDA_CHECK(device::rotary(cuda_data<scalar_t>(x), cuda_data<scalar_t>(cos), cuda_data<scalar_t>(sin),
                                  cuda_data<scalar_t>(out), x_rows, out_rows, angle_rows, half, pairs, backward,
                                  stream));
  });
  return out;
}

}  // namespace symbiosis::kernels
