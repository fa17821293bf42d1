#pragma once
// [Fused decode attention]'s kernels, without LibTorch ([Torch-free kernels] in kernels/launch.h);
// callers use kernels/decode_attention.h.
#include <cstdint>

#include "kernels/launch.h"

namespace symbiosis::kernels::device {

// Keys a block takes: the chunks of one (sequence, kv head) run side by side.
constexpr int kAttentionChunk = 128;
constexpr int kAttentionMaxGroup = 8;  // query heads per kv head
// Query heads per kv head x head_dim: the warps' partial sums fit shared memory.
constexpr int kAttentionMaxGroupDims = 512;

// As many chunks as a cache of `tokens` tokens needs: the grid must not depend on the positions,
// which a captured step reads on the device only.
inline int attention_chunks(int64_t tokens) {
  return static_cast<int>((tokens + kAttentionChunk - 1) / kAttentionChunk);
}

// Strides of a [B, heads, head_dim] operand whose last dimension is contiguous.
struct AttentionRows {
  int64_t sequence, head;
};

// Where a block leaves its chunk's result for the merge: per (sequence, query head, chunk), the
// maximum score m, the sum l of e^(score - m) and the sum acc of e^(score - m) value, in fp32.
struct AttentionPartials {
  float* m;    // [B, heads, chunks]
  float* l;    // [B, heads, chunks]
  float* acc;  // [B, heads, chunks, head_dim]
  int chunks;
};

// decode_attention's operands (kernels/decode_attention.h) as pointers: q [sequences, heads, dim],
// k and v [sequences, kv_heads, dim] at their strides, the cache keys and values [slots, kv_heads,
// tokens, dim] contiguous, slots and positions [sequences], out [sequences, heads, dim] contiguous.
template <typename T>
struct AttentionOperands {
  const T* q;
  AttentionRows q_rows;
  const T* k;
  AttentionRows k_rows;
  const T* v;
  AttentionRows v_rows;
  T* keys;
  T* values;
  const int64_t* slots;
  const int64_t* positions;
  T* out;
  int64_t sequences, heads, kv_heads, dim, tokens;
};

// Writes k and v into the cache and out = the attention, on `stream` (sequences ≥ 1, the shapes
// as decode_attention_supports takes them, partials for attention_chunks(tokens) chunks).
template <typename T>
cudaError_t decode_attention(const AttentionOperands<T>& operands, AttentionPartials partials, cudaStream_t stream);

}  // namespace symbiosis::kernels::device
