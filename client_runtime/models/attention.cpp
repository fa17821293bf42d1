#include "client_runtime/models/attention.h"

#include "client_runtime/cpu_product.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace symbiosis::detail {
namespace {

double lowest(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return std::numeric_limits<float>::lowest();
    case at::kDouble: return std::numeric_limits<double>::lowest();
    case at::kBFloat16: return static_cast<float>(std::numeric_limits<c10::BFloat16>::lowest());
    case at::kHalf: return static_cast<float>(std::numeric_limits<c10::Half>::lowest());
    default: TORCH_CHECK(false, "attention in unsupported dtype ", dtype);
  }
}

// [Logit soft-capping]: transformers' eager attention with a soft cap (Gemma 2's eager_attention_forward).
at::Tensor capped_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                            bool causal, const AttentionScores& scores) {
  const int64_t groups = q.size(1) / k.size(1);
  auto repeated = [&](const at::Tensor& t) { return groups == 1 ? t : t.repeat_interleave(groups, 1); };
  const double scale = scores.scale > 0 ? scores.scale : 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  auto s = soft_cap(at::matmul(q, repeated(k).transpose(-2, -1)) * scale, scores.softcap);
  if (mask.defined()) {
    s = s + mask;
  } else if (causal) {
    const int64_t queries = q.size(2), keys = k.size(2);
    const auto future = at::ones({queries, keys}, q.options().dtype(at::kBool)).triu(keys - queries + 1);
    s = s.masked_fill(future, lowest(s.scalar_type()));
  }
  return at::matmul(at::softmax(s, -1, at::kFloat).to(q.scalar_type()), repeated(v));
}

at::Tensor sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask, bool causal,
                const AttentionScores& scores) {
  if (scores.softcap > 0) return capped_attention(q, k, v, mask, causal, scores);
  const bool grouped = q.size(1) != k.size(1);
  const auto scale = scores.scale > 0 ? std::optional<double>(scores.scale) : std::nullopt;
  return at::scaled_dot_product_attention(q, k, v, mask.defined() ? std::optional<at::Tensor>(mask) : std::nullopt,
                                          /*dropout_p=*/0.0, causal, scale, grouped);
}

// [CPU decode attention]
constexpr int64_t kChunk = 256;  // keys a task reads
constexpr int64_t kBlock = 16;   // floats an inner loop handles: a vector register of AVX-512, two of AVX2
// Tasks a thread takes at least: a short cache is not worth waking the threads for (a task is 256 keys).
constexpr int64_t kTasksPerThread = 16;

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SYMBIOSIS_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define SYMBIOSIS_CPU_CLONES
#endif

inline float as_float(float x) { return x; }
inline float as_float(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

// A chunk's scores [group, n] become e^(s - m_g), m_g the row's largest (out[g][head_dim]); their
// sum goes to out[g][head_dim + 1] and out[g][0, head_dim) is zeroed for the values' sum.
inline __attribute__((always_inline)) void exponentiate_chunk(float* __restrict scores, float* __restrict out,
                                                              int64_t n, int64_t head_dim, int64_t group) {
  const int64_t stride = head_dim + 2;
  for (int64_t g = 0; g < group; ++g) {
    float* acc = out + g * stride;
    const float m = acc[head_dim];
    float sum = 0;
    for (int64_t j = 0; j < n; ++j) {
      const float p = std::exp(scores[g * n + j] - m);
      scores[g * n + j] = p;
      sum += p;
    }
    acc[head_dim + 1] = sum;
    for (int64_t d = 0; d < head_dim; ++d) acc[d] = 0;
  }
}

// One chunk of `n` keys and values ([n, head_dim] each) for the `group` query heads q [group,
// head_dim] (fp32, already scaled): out[g] = {sum_j e^(s_gj - m_g) v_j [head_dim], m_g, sum_j e^(s_gj - m_g)}.
// scores: room for group x n floats; row: for head_dim floats.
template <typename T>
inline __attribute__((always_inline)) void attend_chunk(const float* __restrict q, const T* __restrict keys,
                                                        const T* __restrict values, int64_t n, int64_t head_dim,
                                                        int64_t group, float* __restrict scores, float* __restrict row,
                                                        float* __restrict out) {
  // (__restrict: the buffers never overlap, which lets the compiler keep the loops over them in vectors.)
  const int64_t stride = head_dim + 2;
  for (int64_t g = 0; g < group; ++g) out[g * stride + head_dim] = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) {
    const T* key = keys + j * head_dim;
    for (int64_t d = 0; d < head_dim; d += kBlock) {
      for (int64_t i = 0; i < kBlock; ++i) row[d + i] = as_float(key[d + i]);
    }
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * head_dim;
      float partial[kBlock] = {};
      for (int64_t d = 0; d < head_dim; d += kBlock) {
        for (int64_t i = 0; i < kBlock; ++i) partial[i] += qg[d + i] * row[d + i];
      }
      float s = 0;
      for (int64_t i = 0; i < kBlock; ++i) s += partial[i];
      scores[g * n + j] = s;
      out[g * stride + head_dim] = std::max(out[g * stride + head_dim], s);
    }
  }
  exponentiate_chunk(scores, out, n, head_dim, group);
  for (int64_t j = 0; j < n; ++j) {
    const T* value = values + j * head_dim;
    for (int64_t d = 0; d < head_dim; d += kBlock) {
      for (int64_t i = 0; i < kBlock; ++i) row[d + i] = as_float(value[d + i]);
    }
    for (int64_t g = 0; g < group; ++g) {
      float* __restrict acc = out + g * stride;
      const float p = scores[g * n + j];
      for (int64_t d = 0; d < head_dim; d += kBlock) {
        for (int64_t i = 0; i < kBlock; ++i) acc[d + i] += p * row[d + i];
      }
    }
  }
}

SYMBIOSIS_CPU_CLONES void attend_chunk_fp32(const float* q, const float* keys, const float* values, int64_t n,
                                            int64_t head_dim, int64_t group, float* scores, float* row, float* out) {
  attend_chunk(q, keys, values, n, head_dim, group, scores, row, out);
}

SYMBIOSIS_CPU_CLONES void attend_chunk_bf16(const float* q, const c10::BFloat16* keys, const c10::BFloat16* values,
                                            int64_t n, int64_t head_dim, int64_t group, float* scores, float* row,
                                            float* out) {
  attend_chunk(q, keys, values, n, head_dim, group, scores, row, out);
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
// The same chunk in AVX-512 intrinsics (what the GPU machine's cores run): a key's product with a
// query head in two accumulators of 16 lanes and one reduction, with no trip through memory.
#define SYMBIOSIS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))
SYMBIOSIS_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
SYMBIOSIS_AVX512 inline __m512 load16(const c10::BFloat16* p) {
  const auto halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}

// [Prefetched rows]
// A core streams a chunk's keys, then its values, one row (256 bytes: bf16, head_dim 128) after
// another. On the GPU machine's Intel cores the hardware prefetcher stops at each 4 KiB page, and
// 16 cores read one 7B layer at 64K at 63.5 GB/s of a host that sums 116 to 122; asking for the
// row 32 ahead (past the chunk's end too: the next chunk is most often this core's next task,
// [Balanced tasks]; a prefetch never faults) read 96.0 (SH11 in docs/benchmarks-history.md). On
// this project's AMD development VM the same prefetches slowed it (2 threads 27 -> 23 GB/s), so
// only Intel cores prefetch. The values read are the same either way.
int64_t prefetch_rows() {
  static const int64_t rows = __builtin_cpu_is("intel") ? 32 : 0;
  return rows;
}
template <typename T>
SYMBIOSIS_AVX512 inline void prefetch_row(const T* row, int64_t width) {
  const auto* bytes = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < width * static_cast<int64_t>(sizeof(T)); b += 64) _mm_prefetch(bytes + b, _MM_HINT_T0);
}

// acc[0, 16 x Blocks) = sum_j p[j] values[j x row + 0 .. 16 x Blocks), the sum in registers; the
// row `ahead` rows on is prefetched ([Prefetched rows]; 0: none).
template <int Blocks, typename T>
SYMBIOSIS_AVX512 inline void sum_values(const float* __restrict p, const T* __restrict values, int64_t n, int64_t row,
                                        int64_t ahead, float* __restrict acc) {
  __m512 sums[Blocks];
  for (int b = 0; b < Blocks; ++b) sums[b] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const __m512 weight = _mm512_set1_ps(p[j]);
    const T* value = values + j * row;
    if (ahead > 0) prefetch_row(value + ahead * row, Blocks * kBlock);
    for (int b = 0; b < Blocks; ++b) sums[b] = _mm512_fmadd_ps(weight, load16(value + b * kBlock), sums[b]);
  }
  for (int b = 0; b < Blocks; ++b) _mm512_storeu_ps(acc + b * kBlock, sums[b]);
}

template <typename T>
SYMBIOSIS_AVX512 void attend_chunk_avx512(const float* __restrict q, const T* __restrict keys,
                                          const T* __restrict values, int64_t n, int64_t head_dim, int64_t group,
                                          float* __restrict scores, float* __restrict out) {
  const int64_t stride = head_dim + 2;
  const int64_t ahead = prefetch_rows();
  for (int64_t g = 0; g < group; ++g) out[g * stride + head_dim] = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) {
    const T* key = keys + j * head_dim;
    if (ahead > 0) prefetch_row(key + ahead * head_dim, head_dim);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * head_dim;
      __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
      int64_t d = 0;
      for (; d + 2 * kBlock <= head_dim; d += 2 * kBlock) {
        even = _mm512_fmadd_ps(load16(qg + d), load16(key + d), even);
        odd = _mm512_fmadd_ps(load16(qg + d + kBlock), load16(key + d + kBlock), odd);
      }
      if (d < head_dim) even = _mm512_fmadd_ps(load16(qg + d), load16(key + d), even);
      const float s = _mm512_reduce_add_ps(_mm512_add_ps(even, odd));
      scores[g * n + j] = s;
      out[g * stride + head_dim] = std::max(out[g * stride + head_dim], s);
    }
  }
  exponentiate_chunk(scores, out, n, head_dim, group);
  // The values' sum of each query head, up to 8 x 16 columns at a time in registers (from zero, key
  // by key: the same sums, in the same order, as through memory, without a store and a load a key).
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t d = 0; d < head_dim; d += 8 * kBlock) {
      const float* p = scores + g * n;
      float* acc = out + g * stride + d;
      switch (std::min<int64_t>(8, (head_dim - d) / kBlock)) {
        case 8: sum_values<8>(p, values + d, n, head_dim, ahead, acc); break;
        case 7: sum_values<7>(p, values + d, n, head_dim, ahead, acc); break;
        case 6: sum_values<6>(p, values + d, n, head_dim, ahead, acc); break;
        case 5: sum_values<5>(p, values + d, n, head_dim, ahead, acc); break;
        case 4: sum_values<4>(p, values + d, n, head_dim, ahead, acc); break;
        case 3: sum_values<3>(p, values + d, n, head_dim, ahead, acc); break;
        case 2: sum_values<2>(p, values + d, n, head_dim, ahead, acc); break;
        default: sum_values<1>(p, values + d, n, head_dim, ahead, acc); break;
      }
    }
  }
}

bool has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return has;
}
#else
bool has_avx512() { return false; }
template <typename T>
void attend_chunk_avx512(const float*, const T*, const T*, int64_t, int64_t, int64_t, float*, float*) {}
#endif

}  // namespace

bool cpu_decode_attention_supports(const at::Tensor& q, const at::Tensor& keys, const AttentionScores& scores) {
  const auto dtype = keys.scalar_type();
  return q.device().is_cpu() && keys.device().is_cpu() && (dtype == at::kFloat || dtype == at::kBFloat16) &&
         scores.softcap == 0 && q.dim() == 3 && keys.dim() == 4 && keys.is_contiguous() && q.size(2) == keys.size(3) &&
         keys.size(3) % kBlock == 0 && q.size(1) % keys.size(1) == 0;
}

at::Tensor cpu_decode_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                const std::vector<int64_t>& rows, const std::vector<int64_t>& positions,
                                int64_t sliding_window, double scale) {
  TORCH_CHECK(cpu_decode_attention_supports(q, keys, {}) && values.sizes() == keys.sizes() && values.is_contiguous() &&
                  values.scalar_type() == keys.scalar_type(),
              "cpu_decode_attention takes q [B, heads, head_dim] and a contiguous fp32 or bf16 cache [slots, kv_heads, "
              "tokens, head_dim] (head_dim a multiple of 16), got q ",
              q.sizes(), " and keys ", keys.sizes(), " ", keys.scalar_type());
  // One scope for profilers ([Decode profile] in bench/long_context.cpp): free while none listens.
  RECORD_FUNCTION("symbiosis::cpu_decode_attention", c10::ArrayRef<const c10::IValue>{});
  const WideThreads wide;  // [CPU decode threads]
  const int64_t sequences = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t kv_heads = keys.size(1), tokens = keys.size(2), group = heads / kv_heads;
  TORCH_CHECK(static_cast<int64_t>(rows.size()) == sequences && static_cast<int64_t>(positions.size()) == sequences,
              "cpu_decode_attention: ", rows.size(), " rows and ", positions.size(), " positions for ", sequences,
              " sequences");
  const double softmax_scale = scale > 0 ? scale : 1.0 / std::sqrt(static_cast<double>(head_dim));
  const auto queries = (q.to(at::kFloat) * softmax_scale).contiguous();
  // The tasks: (sequence, kv head, chunk), each sequence's keys first .. positions[b].
  struct Task {
    int64_t sequence, kv_head, first, count;
  };
  std::vector<Task> tasks;
  std::vector<int64_t> first_task(sequences + 1);
  for (int64_t b = 0; b < sequences; ++b) {
    TORCH_CHECK(rows[b] >= 0 && rows[b] < keys.size(0) && positions[b] >= 0 && positions[b] < tokens,
                "cpu_decode_attention: sequence ", b, " in slot ", rows[b], " at position ", positions[b],
                " is outside the cache [", keys.size(0), " slots, ", tokens, " tokens]");
    const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, positions[b] - sliding_window + 1) : 0;
    first_task[b] = static_cast<int64_t>(tasks.size());
    for (int64_t h = 0; h < kv_heads; ++h) {
      for (int64_t start = first; start <= positions[b]; start += kChunk) {
        tasks.push_back({b, h, start, std::min(kChunk, positions[b] + 1 - start)});
      }
    }
  }
  first_task[sequences] = static_cast<int64_t>(tasks.size());
  const int64_t stride = head_dim + 2;
  std::vector<float> partials(tasks.size() * group * stride);
  const float* q_data = queries.data_ptr<float>();
  const bool bf16 = keys.scalar_type() == at::kBFloat16;
  const bool avx512 = has_avx512();
  // [Balanced tasks]: each thread its own keys first, then what the others left.
  nn::detail::balanced_tasks(static_cast<int64_t>(tasks.size()), kTasksPerThread, [&] {
    return [&, scores = std::vector<float>(group * kChunk), row = std::vector<float>(head_dim)](int64_t t) mutable {
      const auto& task = tasks[t];
      const int64_t offset = ((rows[task.sequence] * kv_heads + task.kv_head) * tokens + task.first) * head_dim;
      const float* qg = q_data + (task.sequence * heads + task.kv_head * group) * head_dim;
      float* out = partials.data() + t * group * stride;
      if (avx512) {
        if (bf16) {
          attend_chunk_avx512(qg, keys.const_data_ptr<c10::BFloat16>() + offset,
                              values.const_data_ptr<c10::BFloat16>() + offset, task.count, head_dim, group,
                              scores.data(), out);
        } else {
          attend_chunk_avx512(qg, keys.const_data_ptr<float>() + offset, values.const_data_ptr<float>() + offset,
                              task.count, head_dim, group, scores.data(), out);
        }
      } else if (bf16) {
        attend_chunk_bf16(qg, keys.const_data_ptr<c10::BFloat16>() + offset,
                          values.const_data_ptr<c10::BFloat16>() + offset, task.count, head_dim, group, scores.data(),
                          row.data(), out);
      } else {
        attend_chunk_fp32(qg, keys.const_data_ptr<float>() + offset, values.const_data_ptr<float>() + offset,
                          task.count, head_dim, group, scores.data(), row.data(), out);
      }
    };
  });
  // Each query head's chunks merged, in the order of their keys.
  auto result = at::empty({sequences, heads, head_dim}, at::TensorOptions().dtype(at::kFloat));
  float* merged = result.data_ptr<float>();
  at::parallel_for(0, sequences * kv_heads, kTasksPerThread, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / kv_heads, h = item % kv_heads;
      // This (sequence, kv head)'s tasks lie side by side: its chunks in key order.
      const int64_t per_head = (first_task[b + 1] - first_task[b]) / kv_heads;
      const int64_t t0 = first_task[b] + h * per_head;
      for (int64_t g = 0; g < group; ++g) {
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t t = t0; t < t0 + per_head; ++t) m = std::max(m, partials[(t * group + g) * stride + head_dim]);
        float* dst = merged + (b * heads + h * group + g) * head_dim;
        std::fill(dst, dst + head_dim, 0.0f);
        float sum = 0;
        for (int64_t t = t0; t < t0 + per_head; ++t) {
          const float* part = partials.data() + (t * group + g) * stride;
          const float weight = std::exp(part[head_dim] - m);
          sum += weight * part[head_dim + 1];
          for (int64_t d = 0; d < head_dim; ++d) dst[d] += weight * part[d];
        }
        for (int64_t d = 0; d < head_dim; ++d) dst[d] /= sum;
      }
    }
  });
  return result.to(q.scalar_type());
}

namespace {
thread_local int step_wide_threads = 0;  // [CPU decode threads]: the active StepThreads' wide(), 0 when none
}  // namespace

StepThreads::StepThreads(bool active) : active_(active) {
  if (!active_) return;
  previous_wide_ = step_wide_threads;
  step_wide_threads = at::get_num_threads();
  at::set_num_threads(1);
}

StepThreads::~StepThreads() {
  if (!active_) return;
  at::set_num_threads(step_wide_threads);
  step_wide_threads = previous_wide_;
}

int StepThreads::wide() { return step_wide_threads; }

WideThreads::WideThreads() {
  if (step_wide_threads <= 1) return;
  const int current = at::get_num_threads();
  if (current == step_wide_threads) return;
  previous_ = current;
  at::set_num_threads(step_wide_threads);
}

WideThreads::~WideThreads() {
  if (previous_ > 0) at::set_num_threads(previous_);
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& additive_mask,
                     const AttentionScores& scores) {
  return sdpa(q, k, v, additive_mask, /*causal=*/!additive_mask.defined(), scores);
}

at::Tensor attention_over(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& additive_mask, const AttentionScores& scores) {
  return sdpa(q, k, v, additive_mask, /*causal=*/false, scores);
}

at::Tensor additive_mask(const at::Tensor& allowed, at::ScalarType dtype) {
  return at::zeros(allowed.sizes(), at::TensorOptions().dtype(dtype).device(allowed.device()))
      .masked_fill(allowed.logical_not(), lowest(dtype));
}

at::Tensor soft_cap(const at::Tensor& x, double softcap) { return softcap > 0 ? at::tanh(x / softcap) * softcap : x; }

}  // namespace symbiosis::detail
