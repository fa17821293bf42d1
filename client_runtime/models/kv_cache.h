#pragma once
// The key/value cache of a tenant's generation, and one step's view of it.
//
// [Cached step] A generation step runs the model once over the new tokens of several sequences,
// packed one after another into a single row [1, N, hidden] (no padding: the base layers, the
// executor's work, see exactly the N tokens). Only attention needs to know where each sequence's
// tokens lie: CachedStep says which cache slot each sequence has, how many tokens it already holds
// there (`start`) and how many it adds (`length`). Each layer writes its new keys and values into
// the slots, then every query attends to its own sequence's keys up to its own position:
//  - a decode step (every sequence adds one token) is one attention call for all sequences over
//    the slots they occupy, masked to each one's length;
//  - a step with longer pieces (prefill) attends sequence by sequence, causally.
//
// [Offloaded prefill] A step with longer pieces writes each layer's new keys and values into the
// cache as the layer produces them, and attends over the keys cached before the step (brought to
// the step's device: prefix tuning's past, none for a plain prompt) followed by the step's own keys
// as computed (as the cache stores them: cast to its dtype). It never reads back what it has just
// written, so the cache may lie in host memory while the step computes on a GPU, and what the
// prefill attends over is what a decode step reads from the cache after it.
// Positions are each sequence's own, start .. start+length-1 (RoPE offsets, GPT-2's learned
// positions). Keys are stored rotated, as transformers' cache stores them, so prefix tuning's past
// keys and values ([Model adapter conventions]) are written in front of a sequence as they are.
//
// [Offloaded decode] The baseline that [Host decode] (inference/heterogeneous.h) is measured against,
// and what Hugging Face's OffloadedCache does: the cache lies in host memory (page-locked) while every
// step computes on a GPU. A prefill step writes each layer's keys and values to host memory as they
// are produced ([Offloaded prefill]); a decode step copies each layer's keys and values of the step's
// slots, positions 0 .. the longest sequence's start, to one of two staging buffers on the GPU just
// before the layer attends, and the next layer's into the other buffer on a side stream while this
// one computes (one pitched copy a slot, or one for slots side by side), so a step moves the whole
// cache once over the host link and the GPU holds two layers' worth. The step's new key and value are
// written into the staged buffer (attention reads them there, through the fused decode kernel where
// it applies) and to their place in host memory (one small copy a sequence, on the compute stream).
// Unlike transformers' OffloadedCache, nothing goes back to the host but the new token's keys and
// values. Ordering: the side stream waits for the compute stream before each copy (the buffer it
// overwrites was read by the layer two before; the host positions it reads were written by earlier
// steps), and the compute stream waits for the copy before the layer attends. Decode steps stay eager
// (no CUDA graphs). On a CPU the same path runs with synchronous copies into staging buffers in host
// memory, which is how it is tested without a GPU.
//
// The cache is allocated once, for a stated capacity (sequences x tokens), in the model's dtype on
// its device, and reused: a sequence takes a slot and gives it back when done. Page-locked host
// memory is allocated at its exact size (LibTorch's pinned allocator rounds each block up to a power
// of two, which would double a 128K-token cache of a 7B model to 128 GiB).
// Not thread-safe: one generation loop owns a cache.
#include <ATen/ATen.h>

#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "client_runtime/models/attention.h"
#include "client_runtime/peft/model_adapter.h"

namespace symbiosis {

// One sequence's part of a step; see [Cached step].
struct StepSequence {
  int64_t slot = 0;
  int64_t start = 0;   // tokens the slot holds before this step
  int64_t length = 1;  // tokens this step adds
};

class KvCache {
 public:
  // Keys and values of `layers` layers, [sequences + spare, kv_heads, tokens, head_dim] each. The
  // spare slots are never acquired: padding rows of a fixed decode step write there
  // ([Captured decode] in inference/generator.h). pinned: page-locked host memory (device must be
  // the CPU), which a GPU's prefill writes to without a staging copy ([Host decode] in
  // inference/heterogeneous.h).
  // decode_device: [Offloaded decode], decode steps compute there (a GPU, or the CPU to test the path)
  // over a cache that lies in host memory (device must be the CPU).
  KvCache(const ModelShape& shape, int64_t sequences, int64_t tokens, at::ScalarType dtype, at::Device device,
          int64_t spare = 0, bool pinned = false, std::optional<at::Device> decode_device = std::nullopt);
  ~KvCache();
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;
  // Bytes one position of one sequence takes: keys and values of every layer.
  static int64_t bytes_per_position(const ModelShape& shape, at::ScalarType dtype);
  int64_t sequences() const { return sequences_; }  // the slots requests take, spare ones not counted
  int64_t spare_slot() const;                       // the first spare slot; throws when there is none
  int64_t tokens() const { return tokens_; }        // per sequence
  int64_t layers() const { return static_cast<int64_t>(keys_.size()); }
  // The lowest free slot, or none when every slot is taken.
  std::optional<int64_t> acquire();
  void release(int64_t slot);
  int64_t free_slots() const;
  // Writes per-layer past keys and values ([kv_heads, P, head_dim]) at the front of `slot`.
  void write_prefix(int64_t slot, const std::vector<PastKeyValue>& past);
  at::Tensor& keys(int64_t layer) { return keys_[layer]; }
  at::Tensor& values(int64_t layer) { return values_[layer]; }
  // Bytes held by keys and values together.
  int64_t bytes() const;
  bool pinned() const { return pinned_; }
  // [Offloaded decode]: where decode steps compute, none when they compute where the cache lies.
  std::optional<at::Device> decode_device() const;

  // [LongRoPE]'s recomputation: what a model's steps took as inputs (token embeddings, virtual
  // tokens included) at each slot's positions below `positions`, recorded by the model, so that a
  // sequence whose cached keys go stale there can be run again from its inputs. [sequences + spare,
  // positions, width] of `dtype` where the cache lies, allocated at the first call. recorded_from:
  // the slot's first recorded position (where its own tokens begin, after prefix tuning's past),
  // -1 until the model records one; acquire() starts a slot's record anew.
  at::Tensor& recorded_inputs(int64_t positions, int64_t width, at::ScalarType dtype);
  int64_t& recorded_from(int64_t slot) { return recorded_from_.at(slot); }

  // [Offloaded decode], for CachedStep: copies positions [0, length) of `layer`'s keys and values of
  // `slots` (in the step's order) to staging buffer layer % 2, rows 0 .. slots.size() - 1 (on a GPU,
  // on the side stream, after what the compute stream has queued); then staged(layer) makes the
  // compute stream wait for that copy and returns the buffer's keys and values
  // [sequences, kv_heads, tokens, head_dim]; write_back stores the step's new keys and values
  // ([slots, kv_heads, head_dim] on the decode device) at each sequence's start in host memory.
  void stage(int64_t layer, const std::vector<int64_t>& slots, int64_t length);
  std::pair<at::Tensor, at::Tensor> staged(int64_t layer);
  void write_back(int64_t layer, const std::vector<StepSequence>& sequences, const at::Tensor& keys,
                  const at::Tensor& values);

 private:
  struct Staging;
  int64_t sequences_, spare_, tokens_;
  bool pinned_;
  std::vector<at::Tensor> keys_, values_;
  std::vector<bool> taken_;
  std::unique_ptr<Staging> staging_;    // [Offloaded decode]
  at::Tensor recorded_inputs_;          // [LongRoPE]'s recomputation; undefined until asked for
  std::vector<int64_t> recorded_from_;  // by slot
};

class CachedStep {
 public:
  // The sequences in the order their tokens are packed. Checks each fits its slot. device: where the
  // step computes (its positions and indices live there), by default the cache's; a step with
  // longer pieces may compute on another device than the cache's ([Offloaded prefill]); a step
  // that does attends as one with longer pieces, whatever their lengths.
  CachedStep(KvCache& cache, std::vector<StepSequence> sequences, std::optional<at::Device> device = std::nullopt);
  // [Captured decode] A decode step whose shape does not depend on where the sequences stand, so
  // that it can be captured in a CUDA graph and replayed: one token for each of slots.size(0)
  // sequences, their slots and starts read from the device tensors `slots` and `starts` ([B] int64,
  // which the caller fills before each replay and has checked against the cache; a padding row
  // names a spare slot and start 0), every query attending over all the cache's positions, masked
  // to its own start. Makes no host-to-device copy and reads no device value on the host.
  static CachedStep fixed_decode(KvCache& cache, const at::Tensor& slots, const at::Tensor& starts);
  const std::vector<StepSequence>& sequences() const { return sequences_; }
  int64_t tokens() const { return tokens_; }                // N, the packed tokens
  int64_t cache_tokens() const { return cache_.tokens(); }  // the positions a sequence may reach in the cache
  KvCache& cache() const { return cache_; }
  // A fixed decode step's slots ([B] on the device, padding rows naming a spare slot); undefined in others.
  const at::Tensor& fixed_slots() const { return slots_; }
  bool fixed() const { return sequences_.empty(); }  // made by fixed_decode
  // [N] int64 on the cache's device: each token's position in its sequence.
  const at::Tensor& positions() const { return positions_; }
  // [sequences] int64 on the cache's device: where each sequence's last token lies among the N.
  const at::Tensor& last_tokens() const { return last_tokens_; }
  // Layer `layer`'s attention for the packed tokens: q [1, heads, N, head_dim], k and v
  // [1, kv_heads, N, head_dim] (k rotated where the model rotates) -> [1, heads, N, head_dim].
  // Writes k and v into the cache first. sliding_window > 0: each query sees only the keys of its
  // window ([Sliding window] in models/llama.h). scores: the model's scale and soft cap
  // ([Logit soft-capping] in models/attention.h).
  at::Tensor attend(int64_t layer, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    int64_t sliding_window = 0, const AttentionScores& scores = {}) const;

 private:
  explicit CachedStep(KvCache& cache) : cache_(cache) {}
  // The decode branch of attend() over `keys` and `values` [slots, kv_heads, tokens, head_dim] on the
  // step's device, the step's sequences in rows `rows` (first_row.. side by side when first_row >= 0).
  at::Tensor attend_decode(at::Tensor& keys, at::Tensor& values, const at::Tensor& rows, int64_t first_row,
                           const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t sliding_window,
                           const AttentionScores& scores) const;
  KvCache& cache_;
  std::vector<StepSequence> sequences_;  // empty in a fixed decode step
  int64_t count_ = 0;
  int64_t tokens_ = 0;
  bool decode_ = true;  // every sequence adds one token
  at::Tensor positions_, last_tokens_;
  // Decode steps: the slots and the starts as tensors, the slots' span when they lie side by side,
  // the keys attended (the first decode_keys_ of each slot) and the additive mask
  // [sequences, 1, 1, keys] (undefined when every sequence sees every key).
  at::Tensor slots_, starts_, decode_mask_;
  bool contiguous_slots_ = false;
  int64_t decode_keys_ = 0;
  // Decode steps: the additive masks of sliding windows, by window, made at their first layer's
  // call from the device tensor starts_ (so a captured step makes them anew at each replay).
  mutable std::map<int64_t, at::Tensor> window_masks_;
  // [Offloaded decode]: a decode step over a cache in host memory; the staged rows 0 .. count-1 (on
  // the step's device) and the next layer not yet asked to be staged.
  bool offloaded_ = false;
  at::Tensor staged_rows_;
  mutable int64_t next_staged_ = 0;
};

// The layer's view of a step, which a model's attention takes in place of a mask.
struct CachedLayer {
  const CachedStep* step;
  int64_t layer;
  int64_t sliding_window = 0;  // the layer's window ([Sliding window] in models/llama.h), 0 for none
  at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const AttentionScores& scores = {}) const {
    return step->attend(layer, q, k, v, sliding_window, scores);
  }
};

// A model that generates with a KvCache (LlamaForCausalLM, GPT2LMHeadModel).
class CachedModel {
 public:
  virtual ~CachedModel() = default;
  // The token embedding table [vocab, hidden]: the vocabulary, and the dtype and device the model computes in.
  virtual const at::Tensor& token_embeddings() const = 0;
  // Token embeddings of ids [N] -> [N, hidden].
  virtual at::Tensor embed(const at::Tensor& ids) = 0;
  // The decoder stack over a step's packed inputs [1, N, hidden] -> final hidden states [1, N, hidden].
  virtual at::Tensor forward_cached(const at::Tensor& embeddings, const CachedStep& step) = 0;
  // Hidden states -> logits in the model's dtype.
  virtual at::Tensor logits(const at::Tensor& hidden) = 0;
  // Positions a sequence may reach (GPT-2's n_positions); none for models without such a limit.
  virtual std::optional<int64_t> max_positions() const = 0;
};

// The model's CachedModel; throws naming the module's type when it is not one.
CachedModel& cached_model(torch::nn::Module& model);

}  // namespace symbiosis
