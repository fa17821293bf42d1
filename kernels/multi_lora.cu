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

// x·y over n elements by one warp's lanes, in fp32: W-wide 16-byte loads when `vectors` (x and y
// 16-byte aligned, n a multiple of W; each lane then reads whole vectors, W elements a load: the
// loads, not the arithmetic, are what a decode step's few rows wait for), single elements else.
template <typename T, int W>
__device__ inline float warp_dot(const T* x, const T* y, int64_t n, bool vectors, int lane) {
  float sum = 0.f;
  if (W > 1 && vectors) {
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    const uint4* yv = reinterpret_cast<const uint4*>(y);
    for (int64_t k = lane; k < n / W; k += 32) {
      const uint4 xk = xv[k], yk = yv[k];
      const T* xs = reinterpret_cast<const T*>(&xk);
      const T* ys = reinterpret_cast<const T*>(&yk);
#pragma unroll
      for (int i = 0; i < W; ++i) sum += static_cast<float>(xs[i]) * static_cast<float>(ys[i]);
    }
  } else {
    for (int64_t k = lane; k < n; k += 32) sum += static_cast<float>(x[k]) * static_cast<float>(y[k]);
  }
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_down_sync(0xffffffffu, sum, offset);
  return sum;
}

__device__ inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Shrink (BGMV/SGMV's first product): block per row, a warp per rank index j, h[row, j] = x_row·A_j
// summed in fp32 over `in` by the warp's lanes; W: the vector width x's rows allow (see
// multi_lora below), used where the slot's A allows it too.
template <typename T, int W>
__global__ void __launch_bounds__(kThreads)
    shrink_kernel(const T* x, int64_t in, const int32_t* slots, const MultiLoraSlot* table, int32_t slot_count,
                  float* h, int64_t max_rank) {
  const int64_t row = blockIdx.x;
  const MultiLoraSlot* slot = slot_of(slots, table, slot_count, row);
  if (slot == nullptr) return;
  const T* a = static_cast<const T*>(slot->a);
  const T* xr = x + row * in;
  const bool vectors = aligned16(a);  // then every row of A is, in being a multiple of W
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int j = warp; j < slot->rank; j += kWarps) {
    const float sum = warp_dot<T, W>(xr, a + static_cast<int64_t>(j) * in, in, vectors, lane);
    if (lane == 0) h[row * max_rank + j] = sum;
  }
}

// Expand: block (row, tile of kThreads columns), a thread per column: base + scaling·h_row·B_cᵀ,
// in fp32, rounded once. B_c (the slot's rank elements) is read in 16-byte vectors where the rank
// and B's address allow it: a warp then reads whole consecutive rows of B.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    expand_kernel(const T* base, int64_t base_row_stride, const int32_t* slots, const MultiLoraSlot* table,
                  int32_t slot_count, const float* h, int64_t max_rank, T* out, int64_t columns) {
  constexpr int W = 16 / sizeof(T);
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
    if (rank % W == 0 && aligned16(slot->b)) {
      const uint4* bv = reinterpret_cast<const uint4*>(b);
      for (int v = 0; v < rank / W; ++v) {
        const uint4 bk = bv[v];
        const T* bs = reinterpret_cast<const T*>(&bk);
#pragma unroll
        for (int i = 0; i < W; ++i) dot += h_row[v * W + i] * static_cast<float>(bs[i]);
      }
    } else {
      for (int j = 0; j < rank; ++j) dot += h_row[j] * static_cast<float>(b[j]);
    }
    value += slot->scaling * dot;
  }
  out[row * columns + c] = static_cast<T>(value);
}

}  // namespace

template <typename T>
cudaError_t multi_lora(const T* base, int64_t base_row_stride, const T* x, int64_t in, const int32_t* slots,
                       const MultiLoraSlot* table, int32_t slot_count, float* h, int64_t max_rank, T* out, int64_t rows,
                       int64_t columns, cudaStream_t stream) {
  // 16-byte vectors along `in` where x's rows (and so A's, of the same width) allow them.
  constexpr int kVector = 16 / sizeof(T);
  if (in % kVector == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0) {
    shrink_kernel<T, kVector>
        <<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(x, in, slots, table, slot_count, h, max_rank);
  } else {
    shrink_kernel<T, 1>
        <<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(x, in, slots, table, slot_count, h, max_rank);
  }
  if (const auto status = cudaGetLastError(); status != cudaSuccess) return status;
  const dim3 blocks(static_cast<unsigned>(rows), static_cast<unsigned>((columns + kThreads - 1) / kThreads));
  expand_kernel<T>
      <<<blocks, kThreads, 0, stream>>>(base, base_row_stride, slots, table, slot_count, h, max_rank, out, columns);
  return cudaGetLastError();
}

#define SYMBIOSIS_INSTANTIATE(T)                                                                                 \
  template cudaError_t multi_lora<T>(const T*, int64_t, const T*, int64_t, const int32_t*, const MultiLoraSlot*, \
                                     int32_t, float*, int64_t, T*, int64_t, int64_t, cudaStream_t);
SYMBIOSIS_FOR_KERNEL_TYPES(SYMBIOSIS_INSTANTIATE)
#undef SYMBIOSIS_INSTANTIATE

}  // namespace symbiosis::kernels::device
