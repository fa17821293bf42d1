// [Multi-LoRA kernel]
// [Torch-free kernels] (kernels/launch.h): the kernels; kernels/multi_lora.cpp checks and launches.
#include "kernels/multi_lora_launch.h"

#include <cstdint>

namespace symbiosis::kernels::device {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// The row's slot entry, or null when the row takes no adapter here (no slot, or a slot without
// this layer).
__device__ inline const MultiLoraSlot* slot_of(const int32_t* slots, const MultiLoraSlot* table, int32_t slot_count,
                                               int64_t row) {
  const int32_t s = slots[row];
  if (s < 0 || s >= slot_count || table[s].rank <= 0) return nullptr;
  return table + s;
}

// Shrink (BGMV/SGMV's first product): block per row, a warp per rank index j, h[row, j] = x_row·A_j
// summed in fp32 over `in` by the warp's lanes.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    shrink_kernel(const T* x, int64_t in, const int32_t* slots, const MultiLoraSlot* table, int32_t slot_count,
                  float* h, int64_t max_rank) {
  const int64_t row = blockIdx.x;
  const MultiLoraSlot* slot = slot_of(slots, table, slot_count, row);
  if (slot == nullptr) return;
  const T* a = static_cast<const T*>(slot->a);
  const T* xr = x + row * in;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int j = warp; j < slot->rank; j += kWarps) {
    const T* aj = a + static_cast<int64_t>(j) * in;
    float sum = 0.f;
    for (int64_t k = lane; k < in; k += 32) sum += static_cast<float>(xr[k]) * static_cast<float>(aj[k]);
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_down_sync(0xffffffffu, sum, offset);
    if (lane == 0) h[row * max_rank + j] = sum;
  }
}

// Expand: block (row, tile of kThreads columns), a thread per column: base + scaling·h_row·B_cᵀ,
// in fp32, rounded once.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    expand_kernel(const T* base, int64_t base_row_stride, const int32_t* slots, const MultiLoraSlot* table,
                  int32_t slot_count, const float* h, int64_t max_rank, T* out, int64_t columns) {
  __shared__ float h_row[kMultiLoraMaxRank];
  const int64_t row = blockIdx.x;
  const MultiLoraSlot* slot = slot_of(slots, table, slot_count, row);
  const int rank = slot ? slot->rank : 0;
  for (int j = threadIdx.x; j < rank; j += kThreads) h_row[j] = h[row * max_rank + j];
  __syncthreads();
  const int64_t c = blockIdx.y * int64_t{kThreads} + threadIdx.x;
  if (c >= columns) return;
  float value = static_cast<float>(base[row * base_row_stride + c]);
  if (slot != nullptr) {
    const T* b = static_cast<const T*>(slot->b) + c * rank;
    float dot = 0.f;
    for (int j = 0; j < rank; ++j) dot += h_row[j] * static_cast<float>(b[j]);
    value += slot->scaling * dot;
  }
  out[row * columns + c] = static_cast<T>(value);
}

}  // namespace

template <typename T>
cudaError_t multi_lora(const T* base, int64_t base_row_stride, const T* x, int64_t in, const int32_t* slots,
                       const MultiLoraSlot* table, int32_t slot_count, float* h, int64_t max_rank, T* out,
                       int64_t rows, int64_t columns, cudaStream_t stream) {
  shrink_kernel<T><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(x, in, slots, table, slot_count, h, max_rank);
  if (const auto status = cudaGetLastError(); status != cudaSuccess) return status;
  const dim3 blocks(static_cast<unsigned>(rows), static_cast<unsigned>((columns + kThreads - 1) / kThreads));
  expand_kernel<T><<<blocks, kThreads, 0, stream>>>(base, base_row_stride, slots, table, slot_count, h, max_rank, out,
                                                    columns);
  return cudaGetLastError();
}

#define SYMBIOSIS_INSTANTIATE(T)                                                                              \
  template cudaError_t multi_lora<T>(const T*, int64_t, const T*, int64_t, const int32_t*, const MultiLoraSlot*, \
                                     int32_t, float*, int64_t, T*, int64_t, int64_t, cudaStream_t);
SYMBIOSIS_FOR_KERNEL_TYPES(SYMBIOSIS_INSTANTIATE)
#undef SYMBIOSIS_INSTANTIATE

}  // namespace symbiosis::kernels::device
