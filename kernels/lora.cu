// [Grouped LoRA]
// [Torch-free kernels] (kernels/launch.h): the kernel; kernels/lora.cpp checks and launches.
#include "kernels/lora_launch.h"

#include <cstdint>

namespace symbiosis::kernels::device {
namespace {

constexpr int kThreads = 256;

// Block (row, tile of kThreads columns): each thread one column; h's row in shared memory, in fp32.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    lora_expand_kernel(const T* base, int64_t base_row_stride, const T* h, int64_t rank_total, T* out, int64_t columns,
                       LoraMembers<T> members) {
  __shared__ float h_row[kLoraMaxRankTotal];
  const int64_t row = blockIdx.x;
  for (int64_t j = threadIdx.x; j < rank_total; j += kThreads) h_row[j] = static_cast<float>(h[row * rank_total + j]);
  __syncthreads();
  const int64_t c = blockIdx.y * int64_t{kThreads} + threadIdx.x;
  if (c >= columns) return;
  float value = static_cast<float>(base[row * base_row_stride + c]);
  for (int m = 0; m < members.count; ++m) {
    const int64_t local = c - members.column[m];
    if (local < 0 || local >= members.width[m]) continue;
    const int rank = members.rank[m];
    const T* b_row = members.b[m] + local * rank;
    const float* hm = h_row + members.h_column[m];
    float dot = 0.f;
    for (int j = 0; j < rank; ++j) dot += hm[j] * static_cast<float>(b_row[j]);
    value += members.scaling[m] * dot;
  }
  out[row * columns + c] = static_cast<T>(value);
}

}  // namespace

template <typename T>
cudaError_t lora_expand(const T* base, int64_t base_row_stride, const T* h, int64_t rank_total, T* out, int64_t rows,
                        int64_t columns, const LoraMembers<T>& members, cudaStream_t stream) {
  const dim3 blocks(static_cast<unsigned>(rows), static_cast<unsigned>((columns + kThreads - 1) / kThreads));
  lora_expand_kernel<T><<<blocks, kThreads, 0, stream>>>(base, base_row_stride, h, rank_total, out, columns, members);
  return cudaGetLastError();
}

#define SYMBIOSIS_INSTANTIATE(T)                                                                  \
  template cudaError_t lora_expand<T>(const T*, int64_t, const T*, int64_t, T*, int64_t, int64_t, \
                                      const LoraMembers<T>&, cudaStream_t);
SYMBIOSIS_FOR_FLOATING_TYPES(SYMBIOSIS_INSTANTIATE)
#undef SYMBIOSIS_INSTANTIATE

}  // namespace symbiosis::kernels::device
