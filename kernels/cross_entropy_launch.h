#pragma once
// [Fused cross-entropy]'s kernels, without LibTorch ([Torch-free kernels] in kernels/launch.h);
// callers use kernels/cross_entropy.h.
#include <cstdint>

#include "kernels/launch.h"

namespace symbiosis::kernels::device {

// For logits [rows, vocab] (contiguous) and labels [rows]: lse[r] and losses[r] (0 where labels[r]
// == ignore_index), on `stream`, one block a row (rows ≥ 1).
template <typename T>
cudaError_t cross_entropy_forward(const T* logits, const int64_t* labels, int64_t rows, int64_t vocab,
                                  int64_t ignore_index, float* lse, float* losses, cudaStream_t stream);

// grad [rows, vocab] = *scale · (softmax(logits[r]) - one_hot(labels[r])), 0 on ignored rows.
template <typename T>
cudaError_t cross_entropy_backward(const T* logits, const int64_t* labels, const float* lse, const float* scale,
                                   int64_t rows, int64_t vocab, int64_t ignore_index, T* grad, cudaStream_t stream);

}  // namespace symbiosis::kernels::device
