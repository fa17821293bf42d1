#include "kernels/decode_attention.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>

#include "kernels/device_guard.h"

namespace symbiosis::kernels {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kChunk = 128;           // keys a block takes: the chunks of one (sequence, kv head) run side by side
constexpr int kUnroll = 4;            // keys a warp loads before it uses the first: loads in flight hide their latency
constexpr int kMaxGroup = 8;          // query heads per kv head
constexpr int kMaxGroupDims = 512;    // group x head_dim: the warps' partial sums fit shared memory

__device__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// Strides of a [B, heads, head_dim] operand whose last dimension is contiguous.
struct Rows {
  int64_t sequence, head;
};

// Where a block leaves its chunk's result for merge_kernel: per (sequence, query head, chunk), the
// maximum score m, the sum l of e^(score - m) and the sum acc of e^(score - m) value, in fp32.
struct Partials {
  float* m;    // [B, heads, chunks]
  float* l;    // [B, heads, chunks]
  float* acc;  // [B, heads, chunks, head_dim]
  int chunks;
};

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
      query[g][i] = g < group ? static_cast<float>(q[b * q_rows.sequence + (h * group + g) * q_rows.head + first + i]) * scale
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
void launch(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& keys, at::Tensor& values,
            const at::Tensor& slots, const at::Tensor& positions, at::Tensor& out, int group) {
  const int64_t sequences = q.size(0), heads = q.size(1), kv_heads = k.size(1), dim = q.size(2), tokens = keys.size(2);
  // As many chunks as the cache's capacity needs: the grid must not depend on the positions, which
  // a captured step reads on the device only.
  const int chunks = static_cast<int>((tokens + kChunk - 1) / kChunk);
  const auto floats = q.options().dtype(at::kFloat);
  const auto m = at::empty({sequences, heads, chunks}, floats), l = at::empty({sequences, heads, chunks}, floats);
  const auto acc = at::empty({sequences, heads, chunks, dim}, floats);
  const Partials partials{m.data_ptr<float>(), l.data_ptr<float>(), acc.data_ptr<float>(), chunks};
  const dim3 grid(static_cast<unsigned>(sequences), static_cast<unsigned>(kv_heads), static_cast<unsigned>(chunks));
  const float scale = 1.f / std::sqrt(static_cast<float>(dim));
  const auto stream = at::cuda::getCurrentCUDAStream();
  decode_attention_kernel<T, kPerLane><<<grid, kThreads, 0, stream>>>(
      q.data_ptr<T>(), {q.stride(0), q.stride(1)}, k.data_ptr<T>(), {k.stride(0), k.stride(1)}, v.data_ptr<T>(),
      {v.stride(0), v.stride(1)}, keys.data_ptr<T>(), values.data_ptr<T>(), slots.data_ptr<int64_t>(),
      positions.data_ptr<int64_t>(), partials, kv_heads, group, tokens, scale);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  merge_kernel<T><<<static_cast<unsigned>(sequences * heads), static_cast<unsigned>(dim), 0, stream>>>(
      partials, out.data_ptr<T>(), static_cast<int>(dim));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

bool decode_attention_supports(int64_t heads, int64_t kv_heads, int64_t head_dim, at::ScalarType dtype) {
  const bool dtype_ok = dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf;
  return dtype_ok && kv_heads > 0 && heads % kv_heads == 0 && heads / kv_heads <= kMaxGroup && head_dim % 32 == 0 &&
         head_dim >= 32 && head_dim <= 256 && heads / kv_heads * head_dim <= kMaxGroupDims;
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& keys,
                            at::Tensor& values, const at::Tensor& slots, const at::Tensor& positions) {
  const auto device_guard = on_device_of(q);  // [Operands' device]
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && k.sizes() == v.sizes() && q.size(0) == k.size(0) &&
                  q.size(2) == k.size(2) && q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1,
              "decode_attention: q must be [B, heads, head_dim] and k, v [B, kv_heads, head_dim], the last dimension "
              "contiguous, got ",
              q.sizes(), ", ", k.sizes(), " and ", v.sizes());
  const int64_t heads = q.size(1), kv_heads = k.size(1), dim = q.size(2);
  TORCH_CHECK(decode_attention_supports(heads, kv_heads, dim, q.scalar_type()),
              "decode_attention: ", heads, " heads over ", kv_heads, " kv heads of ", dim, " in ", q.scalar_type(),
              " are not supported (see decode_attention_supports)");
  TORCH_CHECK(keys.dim() == 4 && keys.sizes() == values.sizes() && keys.is_contiguous() && values.is_contiguous() &&
                  keys.size(1) == kv_heads && keys.size(3) == dim,
              "decode_attention: the cache must be two contiguous [slots, ", kv_heads, ", tokens, ", dim,
              "] tensors, got ", keys.sizes(), " and ", values.sizes());
  TORCH_CHECK(slots.dim() == 1 && positions.dim() == 1 && slots.size(0) == q.size(0) && positions.size(0) == q.size(0) &&
                  slots.scalar_type() == at::kLong && positions.scalar_type() == at::kLong,
              "decode_attention: slots and positions must be [", q.size(0), "] int64, got ", slots.sizes(), " ",
              slots.scalar_type(), " and ", positions.sizes(), " ", positions.scalar_type());
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&k, &v, &keys, &values, &slots, &positions}) {
    TORCH_CHECK(t->device() == q.device(), "decode_attention: every operand must be on ", q.device(), ", one is on ",
                t->device());
  }
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&k, &v, &keys, &values}) {
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), "decode_attention: every operand must be ", q.scalar_type(),
                ", one is ", t->scalar_type());
  }
  TORCH_CHECK(q.is_cuda(), "decode_attention: the operands must be on a GPU, got ", q.device());
  auto out = at::empty({q.size(0), heads, dim}, q.options());
  if (q.size(0) == 0) return out;
  const int group = static_cast<int>(heads / kv_heads);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention", [&] {
    switch (dim / 32) {
      case 1: return launch<scalar_t, 1>(q, k, v, keys, values, slots, positions, out, group);
      case 2: return launch<scalar_t, 2>(q, k, v, keys, values, slots, positions, out, group);
      case 3: return launch<scalar_t, 3>(q, k, v, keys, values, slots, positions, out, group);
      case 4: return launch<scalar_t, 4>(q, k, v, keys, values, slots, positions, out, group);
      case 5: return launch<scalar_t, 5>(q, k, v, keys, values, slots, positions, out, group);
      case 6: return launch<scalar_t, 6>(q, k, v, keys, values, slots, positions, out, group);
      case 7: return launch<scalar_t, 7>(q, k, v, keys, values, slots, positions, out, group);
      default: return launch<scalar_t, 8>(q, k, v, keys, values, slots, positions, out, group);
    }
  });
  return out;
}

}  // namespace symbiosis::kernels
