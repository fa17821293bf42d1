// copy_tensors: checks and the segments; the kernel is in kernels/batched_copy.cu ([Torch-free
// kernels] in kernels/launch.h).
#include "kernels/batched_copy.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/batched_copy_launch.h"
#include "kernels/device_guard.h"

namespace symbiosis::kernels {
namespace {

bool aligned16(const at::Tensor& t) {
  return t.nbytes() % 16 == 0 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

}  // namespace

void copy_tensors(const std::vector<at::Tensor>& sources, const std::vector<at::Tensor>& destinations) {
  const auto device_guard = on_device_of(sources.empty() ? at::Tensor() : sources[0]);  // [Operands' device]
  TORCH_CHECK(sources.size() == destinations.size(), "copy_tensors: ", sources.size(), " sources but ",
              destinations.size(), " destinations");
  bool vectorizable = sources.size() <= device::kMaxCopySegments;
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
  device::CopySegments segments{};
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
  C10_CUDA_CHECK(device::copy_segments(segments, vecs, c10::cuda::getCurrentCUDAStream()));
}

}  // namespace symbiosis::kernels
