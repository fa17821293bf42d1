// [Torch-free kernels] (kernels/launch.h): [Fused rotary embedding]'s kernel; kernels/rotary.cpp
// checks and launches.
#include "kernels/rotary_launch.h"

#include <algorithm>
#include <cstdint>

namespace symbiosis::kernels::device {
namespace {

constexpr int kThreads = 256;

// One thread a pair (i, i + half) of one row. Forward: out_i = x_i c_i - x_j s_i and
// out_j = x_j c_j + x_i s_j (j = i + half). Backward, the transpose: dx_i = g_i c_i + g_j s_j and
// dx_j = g_j c_j - g_i s_i.
template <typename T, bool kBackward>
__global__ void __launch_bounds__(kThreads)
    rotary_kernel(const T* x, const T* cos, const T* sin, T* out, RotaryRows x_rows, RotaryRows out_rows,
                  RotaryRows angle_rows, int64_t half, int64_t pairs) {
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

}  // namespace

template <typename T>
cudaError_t rotary(const T* x, const T* cos, const T* sin, T* out, RotaryRows x_rows, RotaryRows out_rows,
                   RotaryRows angle_rows, int64_t half, int64_t pairs, bool backward, cudaStream_t stream) {
  const int blocks = static_cast<int>(std::min<int64_t>((pairs + kThreads - 1) / kThreads, 65535));
  if (backward) {
    rotary_kernel<T, true>
        <<<blocks, kThreads, 0, stream>>>(x, cos, sin, out, x_rows, out_rows, angle_rows, half, pairs);
  } else {
    rotary_kernel<T, false>
        <<<blocks, kThreads, 0, stream>>>(x, cos, sin, out, x_rows, out_rows, angle_rows, half, pairs);
  }
  return cudaGetLastError();
}

#define SYMBIOSIS_INSTANTIATE(T)                                                                                \
  template cudaError_t rotary<T>(const T*, const T*, const T*, T*, RotaryRows, RotaryRows, RotaryRows, int64_t, \
                                 int64_t, bool, cudaStream_t);
SYMBIOSIS_FOR_FLOATING_TYPES(SYMBIOSIS_INSTANTIATE)
#undef SYMBIOSIS_INSTANTIATE

}  // namespace symbiosis::kernels::device
