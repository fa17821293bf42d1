#pragma once
// Scaled dot-product attention for the client's models, through LibTorch's fused kernels (flash
// or memory-efficient attention on a GPU, the math kernel on CPU): one call instead of the eager
// matmul, mask, softmax and matmul, which on a GPU also never materializes the [B, H, T, T] scores.
// This is what transformers' default ("sdpa") attention computes.
//
// [Logit soft-capping] Gemma 2 bounds its attention scores, after scaling and before the mask, to
// softcap · tanh(score / softcap), and its final logits likewise. No fused kernel does that, so a
// soft-capped attention computes as transformers' eager attention does: scores in the model's
// dtype, capped, masked, softmax in fp32, cast back, times the values.
#include <ATen/ATen.h>

#include <vector>

namespace symbiosis {

// How attention turns q·kᵀ into the softmax's input.
struct AttentionScores {
  double scale = 0.0;    // multiplies q·kᵀ; 0: 1/sqrt(head_dim), the default
  double softcap = 0.0;  // > 0: scores become softcap·tanh(score/softcap) ([Logit soft-capping]); 0: none
};

namespace detail {

// q [B, H, Tq, D]; k, v [B, Hkv, Tk, D] with H a multiple of Hkv (grouped-query attention);
// additive_mask [B, 1, Tq, Tk] added to the scores, or undefined for plain causal attention
// (Tq == Tk). Returns [B, H, Tq, D].
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& additive_mask,
                     const AttentionScores& scores = {});

// The same with no causal structure of its own: every query sees every key the mask allows, or
// every key when the mask is undefined.
at::Tensor attention_over(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& additive_mask, const AttentionScores& scores = {});

// [CPU decode attention] A decode step's attention over a long cache in host memory ([Host decode] in
// inference/heterogeneous.h), where LibTorch's CPU kernels read the cache far below the memory's
// bandwidth (scaled_dot_product_attention's flash kernel for one query token reached 5 GB/s in fp32
// and 1.5 GB/s in bf16 on two cores that copy 15 GB/s). The keys of each (sequence, key/value head)
// are cut in chunks of 256 and the chunks of every sequence and head are spread over all the
// threads (split-K, as flash decoding does on a GPU): a chunk's keys are read once for all the query
// heads of their group (grouped-query attention), the scores kept in fp32 with the chunk's running
// maximum and sum, then its values read once; a second pass merges each query head's chunks. So
// the cache is read once a step, by every core, in its storage dtype (fp32 or bf16, converted to fp32
// in registers). Where the cores have AVX-512 (checked once at run time) a chunk runs in its
// intrinsics; elsewhere in loops over fixed blocks of 16 floats, which the compiler vectorizes
// (compiled for AVX2 and plain x86-64, chosen when loaded). The
// softmax and the products are fp32 (LibTorch's math rounds bf16 scores first, so bf16 results may
// differ by bf16 rounding; fp32 ones by the order of the sums).
//
// q [B, heads, head_dim] (the step's queries, one token a sequence); keys, values: a layer's cache
// [slots, kv_heads, tokens, head_dim], contiguous, the step's new keys already written; rows[b]: the
// slot of sequence b; positions[b]: the position of its new token, so that it attends over keys
// 0 .. positions[b] (or the last sliding_window of them when sliding_window > 0); scale: 0 for
// 1/sqrt(head_dim). Returns [B, heads, head_dim] in q's dtype. cpu_decode_attention_supports() says
// which dtypes and shapes it takes (fp32 or bf16, head_dim a multiple of 16, heads a multiple of
// kv_heads, no soft cap).
bool cpu_decode_attention_supports(const at::Tensor& q, const at::Tensor& keys, const AttentionScores& scores);
at::Tensor cpu_decode_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                const std::vector<int64_t>& rows, const std::vector<int64_t>& positions,
                                int64_t sliding_window = 0, double scale = 0.0);

// [CPU decode threads] A CPU decode step (one token a sequence) is some hundred small operations
// and two that read much memory: attention over the cache ([CPU decode attention]) and the
// lm_head's product with the vocabulary. LibTorch forks OpenMP regions for some of the small ones
// too (indexing, concatenation, bf16 products of a LoRA), and a region waits for its slowest
// thread: one that is descheduled (another process on its core, or more threads than the process
// may run) costs a scheduler quantum, milliseconds, where the operation itself takes microseconds
// (measured on a busy 2-core machine: a rotary step's cos and sin 16 ms at 2 threads, 16 us at one).
// So a split model's CPU decode step runs LibTorch with one thread (StepThreads around the step),
// and the wide operations with the threads the step began with (WideThreads around each).
// Both are per thread (OpenMP's thread count is), for the thread that steps.
class StepThreads {
 public:
  // active: LibTorch at one thread until destroyed; inactive: nothing changes.
  explicit StepThreads(bool active);
  ~StepThreads();
  StepThreads(const StepThreads&) = delete;
  StepThreads& operator=(const StepThreads&) = delete;
  // The threads the innermost active StepThreads of this thread began with; 0 when none is active.
  static int wide();

 private:
  int previous_wide_ = 0;
  bool active_ = false;
};

// Within an active StepThreads: LibTorch at the step's wide() threads until destroyed; elsewhere
// nothing changes.
class WideThreads {
 public:
  WideThreads();
  ~WideThreads();
  WideThreads(const WideThreads&) = delete;
  WideThreads& operator=(const WideThreads&) = delete;

 private:
  int previous_ = 0;  // the threads before, when it widened; 0 when it changed nothing
};

// 0 where `allowed` (bool) is true, the dtype's lowest value where it is false.
at::Tensor additive_mask(const at::Tensor& allowed, at::ScalarType dtype);

// softcap · tanh(x / softcap) in x's dtype ([Logit soft-capping]); x itself when softcap is 0.
at::Tensor soft_cap(const at::Tensor& x, double softcap);

}  // namespace detail
}  // namespace symbiosis
