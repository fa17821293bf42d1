// [Torch-free kernels] (kernels/launch.h): copy_tensors' kernel; kernels/batched_copy.cpp checks
// and launches.
#include "kernels/batched_copy_launch.h"

#include <algorithm>
#include <cstdint>

namespace symbiosis::kernels::device {
namespace {

// Each thread copies 16-byte vectors; a binary search finds the segment a vector belongs to.
__global__ void copy_segments_kernel(CopySegments segments, int64_t total_vecs) {
  for (int64_t v = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; v < total_vecs;
       v += int64_t(gridDim.x) * blockDim.x) {
    int lo = 0, hi = segments.count - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (segments.first_vec[mid] <= v)
        lo = mid;
      else
        hi = mid - 1;
    }
    const int64_t i = v - segments.first_vec[lo];
    segments.dst[lo][i] = segments.src[lo][i];
  }
}

}  // namespace

cudaError_t copy_segments(const CopySegments& segments, int64_t total_vecs, cudaStream_t stream) {
  const int threads = 256;
  const int blocks = static_cast<int>(std::min<int64_t>((total_vecs + threads - 1) / threads, 4096));
  copy_segments_kernel<<<blocks, threads, 0, stream>>>(segments, total_vecs);
  return cudaGetLastError();
}

}  // namespace symbiosis::kernels::device
