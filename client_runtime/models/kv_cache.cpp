#include "client_runtime/models/kv_cache.h"

#include <ATen/Parallel.h>
#include <ATen/TensorIndexing.h>

#include <sys/mman.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>

#include "client_runtime/models/attention.h"
#ifdef SYMBIOSIS_WITH_CUDA
#include <c10/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "common/cuda_check.h"
#include "kernels/decode_attention.h"
#endif

namespace symbiosis {

using at::indexing::Slice;

namespace {

#ifdef SYMBIOSIS_WITH_CUDA
// Zeroed page-locked host memory of exactly `sizes` (LibTorch's pinned allocator would round the
// block up to a power of two): mapped, then registered with CUDA; unregistered and unmapped when the
// tensor goes.
at::Tensor pinned_zeros(at::IntArrayRef sizes, at::ScalarType dtype) {
  int64_t elements = 1;
  for (auto size : sizes) elements *= size;
  const size_t bytes = static_cast<size_t>(elements) * c10::elementSize(dtype);
  void* memory = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(memory != MAP_FAILED, "KV cache: cannot map ", bytes, " bytes of host memory: ", std::strerror(errno));
  // Huge pages where the kernel gives them (advice, ignored where transparent huge pages are off):
  // fewer pages to fault in and register, and fewer TLB misses as [CPU decode attention] streams
  // the cache. Then every page first touched by LibTorch's threads, each a contiguous part in order:
  // faulted in by all of them instead of by cudaHostRegister alone, and, where the host has several
  // NUMA nodes, each part on the node of a thread that reads it (the attention splits one
  // sequence's cache among its threads the same way).
  ::madvise(memory, bytes, MADV_HUGEPAGE);
  constexpr int64_t kPage = 4096;
  auto* page_bytes = static_cast<volatile char*>(memory);
  at::parallel_for(0, static_cast<int64_t>((bytes + kPage - 1) / kPage), 1024, [&](int64_t begin, int64_t end) {
    for (int64_t page = begin; page < end; ++page) page_bytes[page * kPage] = 0;
  });
  const auto registered = cudaHostRegister(memory, bytes, cudaHostRegisterDefault);
  if (registered != cudaSuccess) {
    ::munmap(memory, bytes);
    TORCH_CHECK(false, "KV cache: cannot page-lock ", bytes, " bytes of host memory: ", cudaGetErrorString(registered));
  }
  return at::from_blob(
      memory, sizes,
      [bytes](void* p) {
        SYMBIOSIS_CUDA_WARN(cudaHostUnregister(p));
        ::munmap(p, bytes);
      },
      at::TensorOptions().dtype(dtype));
}
#endif

// Copies the 2-D view `src` to the 2-D view `dst` (the same sizes, each row contiguous, rows at any
// pitch), on the current stream when either lies on a GPU: one pitched copy, where LibTorch's copy_
// of views that are not contiguous would gather them on the host first ([Offloaded decode]).
void copy_rows(const at::Tensor& dst, const at::Tensor& src) {
  TORCH_CHECK(dst.dim() == 2 && dst.sizes() == src.sizes() && dst.stride(1) == 1 && src.stride(1) == 1 &&
                  dst.scalar_type() == src.scalar_type(),
              "copy_rows takes two 2-D views of one dtype with contiguous rows, got ", dst.sizes(), " and ",
              src.sizes());
  if (dst.numel() == 0) return;
#ifdef SYMBIOSIS_WITH_CUDA
  if (dst.is_cuda() || src.is_cuda()) {
    const auto element = static_cast<size_t>(dst.element_size());
    const auto device = dst.is_cuda() ? dst.device() : src.device();
    SYMBIOSIS_CUDA_CHECK(cudaMemcpy2DAsync(
        dst.data_ptr(), dst.stride(0) * element, src.data_ptr(), src.stride(0) * element, dst.size(1) * element,
        dst.size(0), cudaMemcpyDefault, c10::cuda::getCurrentCUDAStream(device.index()).stream()));
    return;
  }
#endif
  dst.copy_(src);
}

// Positions [0, length) of slots [first, first + count) of a cache tensor [slots, kv_heads, tokens,
// head_dim] as rows [count x kv_heads, length x head_dim].
at::Tensor prefix_rows(const at::Tensor& cache, int64_t first, int64_t count, int64_t length) {
  const auto tokens = cache.size(2), head_dim = cache.size(3);
  return cache.narrow(0, first, count).view({count * cache.size(1), tokens * head_dim}).narrow(1, 0, length * head_dim);
}

}  // namespace

// [Offloaded decode]: the two staging buffers and, on a GPU, the side stream that fills them.
struct KvCache::Staging {
  explicit Staging(at::Device device) : device(device) {}
  at::Device device;
  std::array<at::Tensor, 2> keys, values;  // [sequences, kv_heads, tokens, head_dim] on `device`; layer l in l % 2
#ifdef SYMBIOSIS_WITH_CUDA
  std::optional<c10::cuda::CUDAStream> copy_stream;
  std::array<c10::cuda::CUDAEvent, 2> copied;  // buffer b's last copy done
  c10::cuda::CUDAEvent compute_ready;          // what the compute stream had queued before a copy
#endif
};

KvCache::KvCache(const ModelShape& shape, int64_t sequences, int64_t tokens, at::ScalarType dtype, at::Device device,
                 int64_t spare, bool pinned, std::optional<at::Device> decode_device)
    : sequences_(sequences),
      spare_(spare),
      tokens_(tokens),
      pinned_(pinned),
      taken_(static_cast<size_t>(std::max<int64_t>(sequences, 0)), false),
      recorded_from_(static_cast<size_t>(std::max<int64_t>(sequences + spare, 0)), -1) {
  TORCH_CHECK(sequences > 0, "KV cache: sequences is ", sequences, ", expected at least 1");
  TORCH_CHECK(tokens > 0, "KV cache: tokens is ", tokens, ", expected at least 1");
  TORCH_CHECK(spare >= 0, "KV cache: spare is ", spare, ", expected at least 0");
  TORCH_CHECK(!pinned || device.is_cpu(), "KV cache: pinned memory is host memory, but the device is ", device);
  TORCH_CHECK(!decode_device || device.is_cpu(), "KV cache: an offloaded cache lies in host memory, but the device is ",
              device);
  const std::vector<int64_t> sizes = {sequences + spare, shape.num_key_value_heads, tokens, shape.head_dim};
  auto allocate = [&] {
#ifdef SYMBIOSIS_WITH_CUDA
    if (pinned) return pinned_zeros(sizes, dtype);
#endif
    return at::zeros(sizes, at::TensorOptions().dtype(dtype).device(device).pinned_memory(pinned));
  };
  for (int64_t i = 0; i < shape.num_layers; ++i) {
    keys_.push_back(allocate());
    values_.push_back(allocate());
  }
  if (decode_device) {
    staging_ = std::make_unique<Staging>(*decode_device);
    const std::vector<int64_t> staged = {sequences, shape.num_key_value_heads, tokens, shape.head_dim};
    for (int b = 0; b < 2; ++b) {
      staging_->keys[b] = at::zeros(staged, at::TensorOptions().dtype(dtype).device(*decode_device));
      staging_->values[b] = at::zeros(staged, at::TensorOptions().dtype(dtype).device(*decode_device));
    }
#ifdef SYMBIOSIS_WITH_CUDA
    if (decode_device->is_cuda()) {
      staging_->copy_stream = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, decode_device->index());
    }
#endif
  }
}

KvCache::~KvCache() = default;

std::optional<at::Device> KvCache::decode_device() const {
  return staging_ ? std::optional<at::Device>(staging_->device) : std::nullopt;
}

void KvCache::stage(int64_t layer, const std::vector<int64_t>& slots, int64_t length) {
  TORCH_CHECK(staging_, "KV cache: stage() on a cache that is not offloaded");
  auto& s = *staging_;
  const int b = static_cast<int>(layer % 2);
  const auto count = static_cast<int64_t>(slots.size());
  auto copy = [&] {
    // One pitched copy for slots side by side (one request always), one a slot otherwise.
    const bool side_by_side =
        std::adjacent_find(slots.begin(), slots.end(), [](int64_t a, int64_t c) { return c != a + 1; }) == slots.end();
    for (auto* pair : {&keys_, &values_}) {
      const auto& from = (*pair)[layer];
      const auto& to = pair == &keys_ ? s.keys[b] : s.values[b];
      if (side_by_side) {
        copy_rows(prefix_rows(to, 0, count, length), prefix_rows(from, slots[0], count, length));
        continue;
      }
      for (int64_t i = 0; i < count; ++i)
        copy_rows(prefix_rows(to, i, 1, length), prefix_rows(from, slots[i], 1, length));
    }
  };
#ifdef SYMBIOSIS_WITH_CUDA
  if (s.copy_stream) {
    c10::cuda::CUDAGuard device_guard(s.device);
    const auto compute = c10::cuda::getCurrentCUDAStream(s.device.index());
    s.compute_ready.record(compute);
    s.compute_ready.block(*s.copy_stream);
    {
      c10::cuda::CUDAStreamGuard on_copy_stream(*s.copy_stream);
      copy();
    }
    s.copied[b].record(*s.copy_stream);
    return;
  }
#endif
  copy();
}

std::pair<at::Tensor, at::Tensor> KvCache::staged(int64_t layer) {
  TORCH_CHECK(staging_, "KV cache: staged() on a cache that is not offloaded");
  auto& s = *staging_;
  const int b = static_cast<int>(layer % 2);
#ifdef SYMBIOSIS_WITH_CUDA
  if (s.copy_stream) s.copied[b].block(c10::cuda::getCurrentCUDAStream(s.device.index()));
#endif
  return {s.keys[b], s.values[b]};
}

void KvCache::write_back(int64_t layer, const std::vector<StepSequence>& sequences, const at::Tensor& keys,
                         const at::Tensor& values) {
  const auto new_keys = keys.contiguous(), new_values = values.contiguous();  // [sequences, kv_heads, head_dim]
  for (size_t i = 0; i < sequences.size(); ++i) {
    const auto& q = sequences[i];
    copy_rows(keys_[layer].select(0, q.slot).select(1, q.start), new_keys[static_cast<int64_t>(i)]);
    copy_rows(values_[layer].select(0, q.slot).select(1, q.start), new_values[static_cast<int64_t>(i)]);
  }
}

int64_t KvCache::spare_slot() const {
  TORCH_CHECK(spare_ > 0, "KV cache: no spare slot");
  return sequences_;
}

std::optional<int64_t> KvCache::acquire() {
  for (size_t i = 0; i < taken_.size(); ++i) {
    if (!taken_[i]) {
      taken_[i] = true;
      recorded_from_[i] = -1;
      return static_cast<int64_t>(i);
    }
  }
  return std::nullopt;
}

void KvCache::release(int64_t slot) {
  TORCH_CHECK(slot >= 0 && slot < sequences_ && taken_[slot], "KV cache: slot ", slot, " is not taken");
  taken_[slot] = false;
}

at::Tensor& KvCache::recorded_inputs(int64_t positions, int64_t width, at::ScalarType dtype) {
  if (!recorded_inputs_.defined()) {
    recorded_inputs_ = at::zeros({sequences_ + spare_, positions, width}, keys_.at(0).options().dtype(dtype));
  }
  TORCH_CHECK(recorded_inputs_.size(1) == positions && recorded_inputs_.size(2) == width,
              "KV cache: recorded inputs of ", recorded_inputs_.sizes(), " asked for again as ", positions,
              " positions of width ", width);
  return recorded_inputs_;
}

int64_t KvCache::free_slots() const { return std::count(taken_.begin(), taken_.end(), false); }

void KvCache::write_prefix(int64_t slot, const std::vector<PastKeyValue>& past) {
  TORCH_CHECK(static_cast<int64_t>(past.size()) == layers(), "past keys and values for ", past.size(),
              " layers, but the cache has ", layers());
  for (int64_t i = 0; i < layers(); ++i) {
    const auto length = past[i].key.size(-2);
    TORCH_CHECK(length <= tokens_, "past keys of ", length, " tokens do not fit a cache of ", tokens_, " per sequence");
    auto unbatched = [](const at::Tensor& t) { return t.dim() == 4 ? t[0] : t; };  // [kv_heads, P, head_dim]
    keys_[i].select(0, slot).narrow(1, 0, length).copy_(unbatched(past[i].key));
    values_[i].select(0, slot).narrow(1, 0, length).copy_(unbatched(past[i].value));
  }
}

int64_t KvCache::bytes_per_position(const ModelShape& shape, at::ScalarType dtype) {
  return 2 * shape.num_layers * shape.num_key_value_heads * shape.head_dim *
         static_cast<int64_t>(c10::elementSize(dtype));
}

int64_t KvCache::bytes() const {
  int64_t total = 0;
  for (size_t i = 0; i < keys_.size(); ++i) total += keys_[i].nbytes() + values_[i].nbytes();
  return total;
}

namespace {

// An additive mask [1, 1, queries, keys] in `dtype`: query i (at position start + i) sees key j
// when j <= start + i, and, with a sliding window, j > start + i - sliding_window.
at::Tensor offset_causal_mask(int64_t start, int64_t queries, int64_t sliding_window, at::ScalarType dtype,
                              at::Device device) {
  const auto long_options = at::TensorOptions().dtype(at::kLong).device(device);
  const int64_t keys = start + queries;
  const auto k = at::arange(keys, long_options).view({1, keys});
  const auto q = (at::arange(queries, long_options) + start).view({queries, 1});
  auto allowed = k <= q;
  if (sliding_window > 0) allowed = allowed.logical_and(k > q - sliding_window);
  return detail::additive_mask(allowed.view({1, 1, queries, keys}), dtype);
}

}  // namespace

CachedStep::CachedStep(KvCache& cache, std::vector<StepSequence> sequences, std::optional<at::Device> device)
    : cache_(cache), sequences_(std::move(sequences)) {
  TORCH_CHECK(!sequences_.empty(), "a cached step needs at least one sequence");
  std::vector<int64_t> positions, last, slots, starts;
  for (const auto& s : sequences_) {
    TORCH_CHECK(s.slot >= 0 && s.slot < cache.sequences(), "cache slot ", s.slot, " is outside [0, ", cache.sequences(),
                ")");
    TORCH_CHECK(s.length >= 1 && s.start >= 0 && s.start + s.length <= cache.tokens(), "a sequence of ", s.start,
                " cached tokens plus ", s.length, " new ones does not fit a cache of ", cache.tokens(),
                " per sequence");
    for (int64_t i = 0; i < s.length; ++i) positions.push_back(s.start + i);
    tokens_ += s.length;
    ++count_;
    last.push_back(tokens_ - 1);
    slots.push_back(s.slot);
    starts.push_back(s.start);
    decode_ = decode_ && s.length == 1;
  }
  const auto cache_device = cache.keys(0).device();
  const auto step_device = device.value_or(cache_device);
  auto to_device = [&](const std::vector<int64_t>& v) { return at::tensor(v, at::kLong).to(step_device); };
  positions_ = to_device(positions);
  last_tokens_ = to_device(last);
  // A step computing away from its cache (a GPU's prefill into host memory) attends as a prefill
  // ([Offloaded prefill]) even when every piece is one token (one-token prompts), unless the cache
  // stages its layers where the step computes ([Offloaded decode]).
  offloaded_ = decode_ && cache.decode_device() == step_device;
  decode_ = decode_ && (step_device == cache_device || offloaded_);
  if (!decode_) return;
  slots_ = to_device(slots);
  starts_ = to_device(starts);
  if (offloaded_) staged_rows_ = at::arange(count_, at::TensorOptions().dtype(at::kLong).device(step_device));
  contiguous_slots_ = true;
  for (size_t i = 1; i < slots.size(); ++i) contiguous_slots_ = contiguous_slots_ && slots[i] == slots[0] + int64_t(i);
  const auto [lowest, highest] = std::minmax_element(starts.begin(), starts.end());
  decode_keys_ = *highest + 1;
  if (*lowest != *highest) {
    const auto long_options = at::TensorOptions().dtype(at::kLong).device(step_device);
    auto allowed = at::arange(decode_keys_, long_options).view({1, decode_keys_}) <= starts_.view({-1, 1});
    decode_mask_ = detail::additive_mask(allowed.view({-1, 1, 1, decode_keys_}), cache.keys(0).scalar_type());
  }
}

CachedStep CachedStep::fixed_decode(KvCache& cache, const at::Tensor& slots, const at::Tensor& starts) {
  TORCH_CHECK(slots.dim() == 1 && slots.sizes() == starts.sizes() && slots.size(0) >= 1,
              "a fixed decode step takes slots and starts of the same length, at least 1, got ", slots.sizes(), " and ",
              starts.sizes());
  CachedStep step(cache);
  step.count_ = step.tokens_ = slots.size(0);
  step.slots_ = slots;
  step.starts_ = starts;
  step.positions_ = starts;
  step.last_tokens_ = at::arange(step.count_, starts.options());
  step.decode_keys_ = cache.tokens();
  auto allowed = at::arange(step.decode_keys_, starts.options()).view({1, step.decode_keys_}) <= starts.view({-1, 1});
  step.decode_mask_ = detail::additive_mask(allowed.view({-1, 1, 1, step.decode_keys_}), cache.keys(0).scalar_type());
  return step;
}

at::Tensor CachedStep::attend(int64_t layer, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              int64_t sliding_window, const AttentionScores& scores) const {
  auto& keys = cache_.keys(layer);
  auto& values = cache_.values(layer);
  TORCH_CHECK(q.size(0) == 1 && q.size(2) == tokens_ && k.size(2) == tokens_, "a cached step of ", tokens_,
              " packed tokens got queries ", q.sizes(), " and keys ", k.sizes());
  if (decode_ && offloaded_) {
    // [Offloaded decode]: this layer's keys and values staged where the step computes (now, for the
    // step's first layer), the next layer's on their way while this one computes.
    std::vector<int64_t> slots;
    for (const auto& s : sequences_) slots.push_back(s.slot);
    for (const auto staged : {layer, layer + 1}) {
      if (staged < next_staged_ || staged >= cache_.layers()) continue;
      cache_.stage(staged, slots, decode_keys_ - 1);
      next_staged_ = staged + 1;
    }
    auto [staged_keys, staged_values] = cache_.staged(layer);
    cache_.write_back(layer, sequences_, k[0].transpose(0, 1), v[0].transpose(0, 1));
    return attend_decode(staged_keys, staged_values, staged_rows_, 0, q, k, v, sliding_window, scores);
  }
  if (decode_) {
    return attend_decode(keys, values, slots_, contiguous_slots_ ? sequences_[0].slot : -1, q, k, v, sliding_window,
                         scores);
  }
  // [Offloaded prefill]: written to the cache, attended over as computed.
  const bool non_blocking = cache_.pinned();  // read on the host only after the step's logits, which wait for it
  std::vector<at::Tensor> outs;
  int64_t offset = 0;
  for (const auto& s : sequences_) {
    // The piece's keys and values as the cache stores them, converted once: written, and attended over.
    const auto new_keys = k.narrow(2, offset, s.length).to(keys.scalar_type());
    const auto new_values = v.narrow(2, offset, s.length).to(values.scalar_type());
    if (non_blocking && q.is_cuda()) {
      // A pitched copy a tensor ([Offloaded decode]'s copy_rows): LibTorch's copy_ to a view of host
      // memory that is not contiguous would go through a pageable buffer, synchronously.
      auto write = [&](at::Tensor& cache, const at::Tensor& stored) {
        const auto heads = cache.size(1), head_dim = cache.size(3);
        copy_rows(cache.select(0, s.slot).narrow(1, s.start, s.length).view({heads, s.length * head_dim}),
                  stored[0].contiguous().view({heads, s.length * head_dim}));
      };
      write(keys, new_keys);
      write(values, new_values);
    } else {
      keys.select(0, s.slot).narrow(1, s.start, s.length).copy_(new_keys[0], non_blocking);
      values.select(0, s.slot).narrow(1, s.start, s.length).copy_(new_values[0], non_blocking);
    }
    auto attended = [&](const at::Tensor& cached, const at::Tensor& stored) {
      const auto computed = stored.to(q.scalar_type());
      if (s.start == 0) return computed;
      const auto before = cached.narrow(0, s.slot, 1).narrow(2, 0, s.start).to(q.device(), q.scalar_type());
      return at::cat({before, computed}, 2);
    };
    auto queries = q.narrow(2, offset, s.length);
    const auto attended_keys = attended(keys, new_keys), attended_values = attended(values, new_values);
    outs.push_back(
        s.start == 0 && sliding_window == 0
            ? detail::attention(queries, attended_keys, attended_values, {}, scores)
            : detail::attention_over(queries, attended_keys, attended_values,
                                     offset_causal_mask(s.start, s.length, sliding_window, q.scalar_type(), q.device()),
                                     scores));
    offset += s.length;
  }
  return outs.size() == 1 ? outs[0] : at::cat(outs, 2);
}

at::Tensor CachedStep::attend_decode(at::Tensor& keys, at::Tensor& values, const at::Tensor& rows, int64_t first_row,
                                     const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     int64_t sliding_window, const AttentionScores& scores) const {
#ifdef SYMBIOSIS_WITH_CUDA
  // On a GPU, one kernel writes and attends ([Fused decode attention] in kernels/decode_attention.h);
  // it attends over every cached key with the default scores, so not for a sliding window, another
  // scale or a soft cap.
  if (q.is_cuda() && sliding_window == 0 && scores.scale == 0 && scores.softcap == 0 &&
      kernels::decode_attention_supports(q.size(1), k.size(1), q.size(3), q.scalar_type())) {
    auto out = kernels::decode_attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), keys, values,
                                         rows, starts_);
    return out.transpose(0, 1).unsqueeze(0);
  }
#endif
  // One token a sequence: written at each one's start, then one attention call for all of them.
  keys.index_put_({rows, Slice(), starts_}, k[0].transpose(0, 1));
  values.index_put_({rows, Slice(), starts_}, v[0].transpose(0, 1));
  const auto queries_by_sequence = q[0].transpose(0, 1);  // [sequences, heads, head_dim]
  if (!sequences_.empty() && detail::cpu_decode_attention_supports(queries_by_sequence, keys, scores)) {
    // [CPU decode attention]: every thread on the cache, read once.
    std::vector<int64_t> row_of, positions;
    for (size_t i = 0; i < sequences_.size(); ++i) {
      row_of.push_back(first_row >= 0 ? first_row + static_cast<int64_t>(i) : sequences_[i].slot);
      positions.push_back(sequences_[i].start);
    }
    return detail::cpu_decode_attention(queries_by_sequence, keys, values, row_of, positions, sliding_window,
                                        scores.scale)
        .transpose(0, 1)
        .unsqueeze(0);
  }
  auto span = [&](const at::Tensor& t) {
    auto prefix = t.narrow(2, 0, decode_keys_);
    return first_row >= 0 ? prefix.narrow(0, first_row, count_) : prefix.index_select(0, rows);
  };
  auto queries = q[0].transpose(0, 1).unsqueeze(2);  // [sequences, heads, 1, head_dim]
  auto mask = decode_mask_;
  if (sliding_window > 0) {
    auto& window_mask = window_masks_[sliding_window];
    if (!window_mask.defined()) {
      // Key j is seen from start when start - sliding_window < j <= start.
      const auto j = at::arange(decode_keys_, starts_.options()).view({1, decode_keys_});
      const auto start = starts_.view({-1, 1});
      const auto allowed = (j <= start).logical_and(j > start - sliding_window);
      window_mask = detail::additive_mask(allowed.view({-1, 1, 1, decode_keys_}), keys.scalar_type());
    }
    mask = window_mask;
  }
  auto out = detail::attention_over(queries, span(keys), span(values), mask, scores);
  return out.squeeze(2).transpose(0, 1).unsqueeze(0);
}

CachedModel& cached_model(torch::nn::Module& model) {
  auto* cached = dynamic_cast<CachedModel*>(&model);
  TORCH_CHECK(cached != nullptr, "model ", model.name(), " cannot generate with a KV cache: it is not a CachedModel");
  return *cached;
}

}  // namespace symbiosis
