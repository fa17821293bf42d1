#pragma once
// [Fused decode attention]
// One decode step's attention over a tenant's KV cache, in one kernel: each sequence's new key and
// value are written at its position in its cache slot, and its query heads attend over that slot's
// keys up to and including the new one. LibTorch's way took five kernels a layer: two index_puts
// writing the keys and values, two index_selects copying every decoding sequence's whole slot out
// of the cache (the cache is [slots, kv_heads, tokens, head_dim] and a step's sequences sit in any
// slots), and the attention itself over the copies, masked to each one's length; on an H200 these
// were 47% of a Llama-3.2-1B inference tenant's own GPU time (docs/benchmarks-history.md,
// `scripts/gpu_check.sh trace-generate`). Here a block of threads takes one chunk of 128 keys of one
// (sequence, kv head), so that the chunks of a long sequence run side by side (split-K, as flash
// decoding does): the block holding the new token writes its key and value, then each block's warps
// split its keys, each keeping a running maximum, sum and weighted value sum for the query heads of
// the group (grouped-query attention) in fp32, and a second small kernel merges the chunks. Keys
// past a sequence's position are never read. Results match LibTorch's attention within fp32
// rounding (the order of the sums differs), then round once to the dtype.
// Built only with CUDA; client_runtime/models/kv_cache.cpp calls it on a GPU.
#include <ATen/ATen.h>

namespace symbiosis::kernels {

// Whether decode_attention takes these shapes: head_dim a multiple of 32 up to 256, heads a
// multiple of kv_heads with at most 8 query heads per kv head and at most 512 elements of their
// heads together (query heads per kv head x head_dim), fp32, bf16 or fp16.
bool decode_attention_supports(int64_t heads, int64_t kv_heads, int64_t head_dim, at::ScalarType dtype);

// q [B, heads, head_dim] and k, v [B, kv_heads, head_dim] (any strides, the last dimension
// contiguous): the step's queries, keys and values, one token a sequence. keys, values: the
// layer's cache [slots, kv_heads, tokens, head_dim], contiguous; slots, positions: [B] int64, each
// sequence's slot and the position its token takes (the tokens it held before). Writes k and v
// into the cache and returns the attention output [B, heads, head_dim], softmax scale
// 1/sqrt(head_dim). Everything on one GPU in one dtype (slots and positions int64).
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& keys,
                            at::Tensor& values, const at::Tensor& slots, const at::Tensor& positions);

}  // namespace symbiosis::kernels
