#include "kernels/rotary.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "kernels/device_guard.h"

namespace symbiosis::kernels {
namespace {

constexpr int kThreads = 256;

// Where row (b, h, t) of a [B, H, T, D] tensor starts, by its strides.
struct Rows {
  int64_t heads, tokens;
  int64_t batch_stride, head_stride, token_stride;
  __device__ int64_t offset(int64_t row) const {
    const int64_t t = row % tokens;
    const int64_t bh = row / tokens;
    return (bh / heads) * batch_stride + (bh % heads) * head_stride + t * token_stride;
  }
};

// One thread a pair (i, i + half) of one row. Forward: out_i = x_i c_i - x_j s_i and
// out_j = x_j c_j + x_i s_j (j = i + half). Backward, the transpose: dx_i = g_i c_i + g_j s_j and
// dx_j = g_j c_j - g_i s_i.
template <typename T, bool kBackward>
__global__ void __launch_bounds__(kThreads)
    rotary_kernel(const T* x, const T* cos, const T* sin, T* out, Rows x_rows, Rows out_rows, Rows angle_rows,
                  int64_t half, int64_t pairs) {
  for (int64_t p = blockIdx.x * int64_t{kThreads} + threadIdx.x; p < pairs; p += int64_t{gridDim.x} * kThreads) {
    const int64_t row = p / half, i = p % half, j = i + half;
    const T* xr = x + x_rows.offset(row);
    const int64_t a = angle_rows.offset(row);
    const float xi = static_cast<float>(xr[i]), xj = static_cast<float>(xr[j]);
    const float ci = static_cast<float>(cos[a + i]), cj = static_cast<float>(cos[a + j]);
    const float si = static_cast<float>(sin[a + i]), sj = static_cast<float>(sin[a + j]);
    T* o = out + out_rows.offset(row);
    if (kBackward) {
      o[i] = static_cast<T>(xi * ci + xj * sj);
      o[j] = static_cast<T>(xj * cj - xi * si);
    } else {
      o[i] = static_cast<T>(xi * ci - xj * si);
      o[j] = static_cast<T>(xj * cj + xi * sj);
    }
  }
}

Rows rows_of(const at::Tensor& t, int64_t heads, int64_t tokens) {
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
    TORCH_CHECK(angles->dim() == 4 && (angles->size(0) == 1 || angles->size(0) == x.size(0)) &&
                    angles->size(1) == 1 && angles->size(2) == x.size(2) && angles->size(3) == x.size(3) &&
                    angles->stride(3) == 1 && angles->scalar_type() == x.scalar_type() &&
                    angles->device() == x.device(),
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
  const int blocks = static_cast<int>(std::min<int64_t>((pairs + kThreads - 1) / kThreads, 65535));
  const auto stream = at::cuda::getCurrentCUDAStream();
  const Rows x_rows = rows_of(x, heads, tokens), out_rows = rows_of(out, heads, tokens);
  const Rows angle_rows = rows_of(cos, heads, tokens);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary", [&] {
    const auto* xp = x.data_ptr<scalar_t>();
    const auto* cp = cos.data_ptr<scalar_t>();
    const auto* sp = sin.data_ptr<scalar_t>();
    auto* op = out.data_ptr<scalar_t>();
    if (backward) {
      rotary_kernel<scalar_t, true><<<blocks, kThreads, 0, stream>>>(xp, cp, sp, op, x_rows, out_rows, angle_rows,
                                                                     half, pairs);
    } else {
      rotary_kernel<scalar_t, false><<<blocks, kThreads, 0, stream>>>(xp, cp, sp, op, x_rows, out_rows, angle_rows,
                                                                      half, pairs);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace symbiosis::kernels
