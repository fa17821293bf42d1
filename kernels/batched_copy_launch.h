#pragma once
// copy_tensors' kernel (kernels/batched_copy.h), without LibTorch ([Torch-free kernels] in
// kernels/launch.h).
#include <cstdint>

#include "kernels/launch.h"

namespace symbiosis::kernels::device {

constexpr int kMaxCopySegments = 64;

// Up to kMaxCopySegments copies of 16-byte vectors: segment s covers [first_vec[s], first_vec[s+1])
// of the combined range, from src[s] to dst[s].
struct CopySegments {
  const int4* src[kMaxCopySegments];
  int4* dst[kMaxCopySegments];
  int64_t first_vec[kMaxCopySegments + 1];
  int count;
};

// Copies the segments' total_vecs vectors (at least one), on `stream`.
cudaError_t copy_segments(const CopySegments& segments, int64_t total_vecs, cudaStream_t stream);

}  // namespace symbiosis::kernels::device
