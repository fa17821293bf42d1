#include "kernels/batched_copy.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include "kernels/device_guard.h"

namespace symbiosis::kernels {
namespace {

constexpr int kMaxSegments = 64;

// Up to kMaxSegments copies of 16-byte vectors: segment s covers [first_vec[s], first_vec[s+1])
// of the combined range, from src[s] to dst[s].
struct Segments {
  const int4* src[kMaxSegments];
  int4* dst[kMaxSegments];
  int64_t first_vec[kMaxSegments + 1];
  int count;
};

// Each thread copies 16-byte vectors; a binary search finds the segment a vector belongs to.
__global__ void copy_segments_kernel(Segments segments, int64_t total_vecs) {
  for (int64_t v = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; v < total_vecs;
       v += int64_t(gridDim.x) * blockDim.x) {
    int lo = 0, hi = segments.count - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (segments.first_vec[mid] <= v) lo = mid; else hi = mid - 1;
    }
    const int64_t i = v - segments.first_vec[lo];
    segments.dst[lo][i] = segments.src[lo][i];
  }
}

bool aligned16(const at::Tensor& t) {
  return t.nbytes() % 16 == 0 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

}  // namespace

void copy_tensors(const std::vector<at::Tensor>& sources, const std::vector<at::Tensor>& destinations) {
  const auto device_guard = on_device_of(sources.empty() ? at::Tensor() : sources[0]);  // [Operands' device]
  TORCH_CHECK(sources.size() == destinations.size(), "copy_tensors: ", sources.size(), " sources but ",
              destinations.size(), " destinations");
  bool vectorizable = sources.size() <= kMaxSegments;
  for (size_t i = 0; i < sources.size(); ++i) {
    const auto& s = sources[i];
    const auto& d = destinations[i];
    TORCH_CHECK(s.is_cuda() && d.is_cuda() && s.device() == d.device() && s.is_contiguous() && d.is_contiguous() &&
                    s.nbytes() == d.nbytes(),
                "copy_tensors: pair ", i, " must be contiguous tensors of equal size on one CUDA device, got ",
                s.sizes(), " on ", s.device(), " and ", d.sizes(), " on ", d.device());
    vectorizable = vectorizable && aligned16(s) && aligned16(d);
  }
  if (!vectorizable) {
    for (size_t i = 0; i < sources.size(); ++i) destinations[i].view_as(sources[i]).copy_(sources[i], true);
    return;
  }
  Segments segments{};
  segments.count = static_cast<int>(sources.size());
  int64_t vecs = 0;
  for (size_t i = 0; i < sources.size(); ++i) {
    segments.src[i] = static_cast<const int4*>(sources[i].data_ptr());
    segments.dst[i] = static_cast<int4*>(destinations[i].data_ptr());
    segments.first_vec[i] = vecs;
    vecs += sources[i].nbytes() / 16;
  }
  segments.first_vec[sources.size()] = vecs;
  if (vecs == 0) return;
  const int threads = 256;
  const int blocks = static_cast<int>(std::min<int64_t>((vecs + threads - 1) / threads, 4096));
  copy_segments_kernel<<<blocks, threads, 0, at::cuda::getCurrentCUDAStream()>>>(segments, vecs);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace symbiosis::kernels
