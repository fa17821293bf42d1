#include "kernels/pack_rows.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

namespace symbiosis::kernels {
namespace {

constexpr int kMaxParts = 64;

struct PackArgs {
  const int4* src[kMaxParts];
  int64_t first_vec[kMaxParts + 1];  // prefix sums of each part's size in 16-byte vectors
  int parts;
};

// Each thread copies 16-byte vectors; a binary search finds the part a vector belongs to.
__global__ void pack_rows_kernel(PackArgs args, int4* dst, int64_t total_vecs) {
  for (int64_t v = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; v < total_vecs;
       v += int64_t(gridDim.x) * blockDim.x) {
    int lo = 0, hi = args.parts - 1;
    while (lo < hi) {
      int mid = (lo + hi + 1) / 2;
      if (args.first_vec[mid] <= v) lo = mid; else hi = mid - 1;
    }
    dst[v] = args.src[lo][v - args.first_vec[lo]];
  }
}

}  // namespace

at::Tensor pack_rows(const std::vector<at::Tensor>& parts) {
  TORCH_CHECK(!parts.empty(), "pack_rows needs at least one part");
  const auto& first = parts[0];
  int64_t rows = 0;
  bool vectorizable = parts.size() <= kMaxParts;
  for (const auto& p : parts) {
    TORCH_CHECK(p.is_cuda() && p.is_contiguous() && p.dim() == 2 && p.size(1) == first.size(1) &&
                    p.scalar_type() == first.scalar_type() && p.device() == first.device(),
                "pack_rows: every part must be a contiguous [tokens, ", first.size(1), "] ", first.scalar_type(),
                " tensor on ", first.device());
    rows += p.size(0);
    vectorizable = vectorizable && p.nbytes() % 16 == 0 && reinterpret_cast<uintptr_t>(p.data_ptr()) % 16 == 0;
  }
  if (!vectorizable) return at::cat(parts, 0);
  auto out = at::empty({rows, first.size(1)}, first.options());
  PackArgs args{};
  args.parts = static_cast<int>(parts.size());
  int64_t vecs = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    args.src[i] = static_cast<const int4*>(parts[i].data_ptr());
    args.first_vec[i] = vecs;
    vecs += parts[i].nbytes() / 16;
  }
  args.first_vec[parts.size()] = vecs;
  if (vecs == 0) return out;
  const int threads = 256;
  const int blocks = static_cast<int>(std::min<int64_t>((vecs + threads - 1) / threads, 4096));
  pack_rows_kernel<<<blocks, threads, 0, at::cuda::getCurrentCUDAStream()>>>(args, static_cast<int4*>(out.data_ptr()),
                                                                            vecs);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace symbiosis::kernels
