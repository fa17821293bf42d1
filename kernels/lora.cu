// [Grouped LoRA]
#include "kernels/lora.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/device_guard.h"

namespace symbiosis::kernels {
namespace {

constexpr int kThreads = 256;

template <typename T>
struct Members {
  int count;
  int64_t column[kLoraMaxMembers], width[kLoraMaxMembers];
  int rank[kLoraMaxMembers], h_column[kLoraMaxMembers];
  float scaling[kLoraMaxMembers];
  const T* b[kLoraMaxMembers];
};

// Block (row, tile of kThreads columns): each thread one column; h's row in shared memory, in fp32.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    lora_expand_kernel(const T* base, int64_t base_row_stride, const T* h, int64_t rank_total, T* out,
                       int64_t columns, Members<T> members) {
  __shared__ float h_row[kLoraMaxRankTotal];
  const int64_t row = blockIdx.x;
  for (int64_t j = threadIdx.x; j < rank_total; j += kThreads) h_row[j] = static_cast<float>(h[row * rank_total + j]);
  __syncthreads();
  const int64_t c = blockIdx.y * int64_t{kThreads} + threadIdx.x;
  if (c >= columns) return;
  float value = static_cast<float>(base[row * base_row_stride + c]);
  for (int m = 0; m < members.count; ++m) {
    const int64_t local = c - members.column[m];
    if (local < 0 || local >= members.width[m]) continue;
    const int rank = members.rank[m];
    const T* b_row = members.b[m] + local * rank;
    const float* hm = h_row + members.h_column[m];
    float dot = 0.f;
    for (int j = 0; j < rank; ++j) dot += hm[j] * static_cast<float>(b_row[j]);
    value += members.scaling[m] * dot;
  }
  out[row * columns + c] = static_cast<T>(value);
}

void check_members(const at::Tensor& t, const std::vector<LoraMember>& members, int64_t columns,
                   int64_t rank_total) {
  TORCH_CHECK(!members.empty() && members.size() <= kLoraMaxMembers, "lora_expand: takes 1 to ", kLoraMaxMembers,
              " members, got ", members.size());
  TORCH_CHECK(rank_total <= kLoraMaxRankTotal, "lora_expand: the members' ranks add up to ", rank_total,
              ", at most ", kLoraMaxRankTotal, " expected");
  for (const auto& m : members) {
    TORCH_CHECK(m.b.defined() && m.b.dim() == 2 && m.b.is_contiguous() && m.b.size(0) == m.width &&
                    m.b.scalar_type() == t.scalar_type() && m.b.device() == t.device(),
                "lora_expand: a member's B must be [", m.width, ", rank] contiguous in ", t.scalar_type(), " on ",
                t.device(), ", got ", m.b.sizes(), " in ", m.b.scalar_type());
    TORCH_CHECK(m.column >= 0 && m.column + m.width <= columns && m.h_column >= 0 &&
                    m.h_column + m.b.size(1) <= rank_total,
                "lora_expand: a member's columns [", m.column, ", ", m.column + m.width, ") or rank columns [",
                m.h_column, ", ", m.h_column + m.b.size(1), ") lie outside [0, ", columns, ") and [0, ", rank_total,
                ")");
  }
}

template <typename T>
Members<T> pack(const std::vector<LoraMember>& members) {
  Members<T> packed{};
  packed.count = static_cast<int>(members.size());
  for (size_t i = 0; i < members.size(); ++i) {
    packed.column[i] = members[i].column;
    packed.width[i] = members[i].width;
    packed.rank[i] = static_cast<int>(members[i].b.size(1));
    packed.h_column[i] = static_cast<int>(members[i].h_column);
    packed.scaling[i] = static_cast<float>(members[i].scaling);
    packed.b[i] = members[i].b.data_ptr<T>();
  }
  return packed;
}

}  // namespace

at::Tensor lora_expand(const at::Tensor& base, const at::Tensor& h, const std::vector<LoraMember>& members) {
  const auto device_guard = on_device_of(base);  // [Operands' device]
  TORCH_CHECK(base.is_cuda() && base.dim() == 2 && base.stride(1) == 1 && at::isFloatingType(base.scalar_type()),
              "lora_expand: base must be a 2-D floating CUDA tensor with its last dimension contiguous, got ",
              base.sizes(), " with strides ", base.strides(), " on ", base.device());
  TORCH_CHECK(h.is_contiguous() && h.dim() == 2 && h.size(0) == base.size(0) &&
                  h.scalar_type() == base.scalar_type() && h.device() == base.device(),
              "lora_expand: h must be [", base.size(0), ", rank] contiguous in ", base.scalar_type(), ", got ",
              h.sizes(), " in ", h.scalar_type());
  check_members(base, members, base.size(1), h.size(1));
  auto out = at::empty(base.sizes(), base.options());
  if (base.numel() == 0) return out;
  const auto stream = at::cuda::getCurrentCUDAStream();
  const dim3 blocks(static_cast<unsigned>(base.size(0)), static_cast<unsigned>((base.size(1) + kThreads - 1) / kThreads));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, base.scalar_type(), "lora_expand", [&] {
    lora_expand_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(base.data_ptr<scalar_t>(), base.stride(0),
                                                                   h.data_ptr<scalar_t>(), h.size(1),
                                                                   out.data_ptr<scalar_t>(), base.size(1),
                                                                   pack<scalar_t>(members));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace symbiosis::kernels
