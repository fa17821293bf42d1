// [Torch-free kernels] (kernels/launch.h): [Fused decode attention]'s kernels;
// kernels/decode_attention.cpp checks, allocates and launches.
#include "kernels/decode_attention_launch.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace symbiosis::kernels::device {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kUnroll = 4;  // keys a warp loads before it uses the first: loads in flight hide their latency
// The header's names, as the kernels use them.
constexpr int kChunk = kAttentionChunk;
constexpr int kMaxGroup = kAttentionMaxGroup;
constexpr int kMaxGroupDims = kAttentionMaxGroupDims;
using Rows = AttentionRows;
using Partials = AttentionPartials;

__device__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// One block per (sequence b, kv head h, chunk c of kChunk keys); each lane holds kPerLane
// consecutive elements of a row. Chunks past the sequence's position leave m = -inf.
template <typename T, int kPerLane>
__global__ void __launch_bounds__(kThreads)
    decode_attention_kernel(const T* q, Rows q_rows, const T* k, Rows k_rows, const T* v, Rows v_rows, T* keys,
                            T* values, const int64_t* slots, const int64_t* positions, Partials partials,
                            int64_t kv_heads, int group, int64_t tokens, float scale) {
  constexpr int kDim = 32 * kPerLane;
  const int64_t b = blockIdx.x, h = blockIdx.y, chunk = blockIdx.z;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t position = positions[b];
  const int64_t begin = chunk * kChunk, end = std::min<int64_t>(begin + kChunk, position + 1);  // keys [begin, end)
  T* key_rows = keys + (slots[b] * kv_heads + h) * tokens * kDim;
  T* value_rows = values + (slots[b] * kv_heads + h) * tokens * kDim;
  // 1. The new key and value, written by the block whose chunk holds them, which alone reads them
  //    (visible to it after the barrier).
  if (begin <= position && position < begin + kChunk) {
    for (int d = threadIdx.x; d < kDim; d += kThreads) {
      key_rows[position * kDim + d] = k[b * k_rows.sequence + h * k_rows.head + d];
      value_rows[position * kDim + d] = v[b * v_rows.sequence + h * v_rows.head + d];
    }
  }
  __syncthreads();
  // 2. Each warp takes every kWarps-th key: a running maximum m, sum l and weighted value sum acc per
  //    query head of the group.
  const int first = lane * kPerLane;
  float query[kMaxGroup][kPerLane], m[kMaxGroup], l[kMaxGroup], acc[kMaxGroup][kPerLane];
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      acc[g][i] = 0.f;
      query[g][i] = g < group
                        ? static_cast<float>(q[b * q_rows.sequence + (h * group + g) * q_rows.head + first + i]) * scale
                        : 0.f;
    }
  }
  for (int64_t base = begin + warp; base < end; base += kWarps * kUnroll) {
    float key[kUnroll][kPerLane], value[kUnroll][kPerLane];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t t = base + u * kWarps;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        key[u][i] = t < end ? static_cast<float>(key_rows[t * kDim + first + i]) : 0.f;
        value[u][i] = t < end ? static_cast<float>(value_rows[t * kDim + first + i]) : 0.f;
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * kWarps >= end) break;
#pragma unroll
      for (int g = 0; g < kMaxGroup; ++g) {
        if (g >= group) break;
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) s += query[g][i] * key[u][i];
        s = warp_sum(s);
        const float m_new = fmaxf(m[g], s);
        const float shrink = expf(m[g] - m_new), p = expf(s - m_new);
        l[g] = l[g] * shrink + p;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) acc[g][i] = acc[g][i] * shrink + p * value[u][i];
        m[g] = m_new;
      }
    }
  }
  // 3. The warps' results merged into the chunk's: M = max_w m_w, L = sum_w l_w e^(m_w - M) and
  //    ACC = sum_w acc_w e^(m_w - M).
  __shared__ float partial_m[kWarps][kMaxGroup], partial_l[kWarps][kMaxGroup];
  __shared__ float partial_acc[kWarps][kMaxGroupDims];
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
    if (g >= group) break;
    if (lane == 0) {
      partial_m[warp][g] = m[g];
      partial_l[warp][g] = l[g];
    }
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) partial_acc[warp][g * kDim + first + i] = acc[g][i];
  }
  __syncthreads();
  for (int e = threadIdx.x; e < group * kDim; e += kThreads) {
    const int g = e / kDim, d = e % kDim;
    float highest = -INFINITY;
    for (int w = 0; w < kWarps; ++w) highest = fmaxf(highest, partial_m[w][g]);
    float sum = 0.f, weighted = 0.f;
    for (int w = 0; w < kWarps; ++w) {
      if (partial_m[w][g] == -INFINITY) continue;  // a warp that had no key
      const float scale_w = expf(partial_m[w][g] - highest);
      sum += partial_l[w][g] * scale_w;
      weighted += partial_acc[w][e] * scale_w;
    }
    const int64_t row = (b * kv_heads * group + h * group + g) * partials.chunks + chunk;
    if (d == 0) {
      partials.m[row] = highest;
      partials.l[row] = sum;
    }
    partials.acc[row * kDim + d] = weighted;
  }
}

// One block per (sequence, query head), a thread per element: the chunks' results merged,
// out = sum_c acc_c e^(m_c - M) / sum_c l_c e^(m_c - M).
template <typename T>
__global__ void merge_kernel(Partials partials, T* out, int dim) {
  const int64_t row = blockIdx.x;  // b * heads + head
  const float* m = partials.m + row * partials.chunks;
  const float* l = partials.l + row * partials.chunks;
  float highest = -INFINITY;
  for (int c = 0; c < partials.chunks; ++c) highest = fmaxf(highest, m[c]);
  for (int d = threadIdx.x; d < dim; d += blockDim.x) {
    float sum = 0.f, weighted = 0.f;
    for (int c = 0; c < partials.chunks; ++c) {
      if (m[c] == -INFINITY) continue;  // a chunk past the sequence's position
      const float scale_c = expf(m[c] - highest);
      sum += l[c] * scale_c;
      weighted += partials.acc[(row * partials.chunks + c) * dim + d] * scale_c;
    }
    out[row * dim + d] = static_cast<T>(weighted / sum);
  }
}

template <typename T, int kPerLane>
cudaError_t launch(const AttentionOperands<T>& o, Partials partials, cudaStream_t stream) {
  const int group = static_cast<int>(o.heads / o.kv_heads);
  const dim3 grid(static_cast<unsigned>(o.sequences), static_cast<unsigned>(o.kv_heads),
                  static_cast<unsigned>(partials.chunks));
  const float scale = 1.f / std::sqrt(static_cast<float>(o.dim));
  decode_attention_kernel<T, kPerLane><<<grid, kThreads, 0, stream>>>(o.q, o.q_rows, o.k, o.k_rows, o.v, o.v_rows,
                                                                      o.keys, o.values, o.slots, o.positions, partials,
                                                                      o.kv_heads, group, o.tokens, scale);
  if (const cudaError_t error = cudaGetLastError(); error != cudaSuccess) return error;
  merge_kernel<T><<<static_cast<unsigned>(o.sequences * o.heads), static_cast<unsigned>(o.dim), 0, stream>>>(
      partials, o.out, static_cast<int>(o.dim));
  return cudaGetLastError();
}

}  // namespace

template <typename T>
cudaError_t decode_attention(const AttentionOperands<T>& operands, AttentionPartials partials, cudaStream_t stream) {
  switch (operands.dim / 32) {
    case 1: return launch<T, 1>(operands, partials, stream);
    case 2: return launch<T, 2>(operands, partials, stream);
    case 3: return launch<T, 3>(operands, partials, stream);
    case 4: return launch<T, 4>(operands, partials, stream);
    case 5: return launch<T, 5>(operands, partials, stream);
    case 6: return launch<T, 6>(operands, partials, stream);
    case 7: return launch<T, 7>(operands, partials, stream);
    default: return launch<T, 8>(operands, partials, stream);
  }
}

#define SYMBIOSIS_INSTANTIATE(T) \
  template cudaError_t decode_attention<T>(const AttentionOperands<T>&, AttentionPartials, cudaStream_t);
SYMBIOSIS_FOR_KERNEL_TYPES(SYMBIOSIS_INSTANTIATE)
#undef SYMBIOSIS_INSTANTIATE

}  // namespace symbiosis::kernels::device
