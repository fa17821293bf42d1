// [Grouped LoRA]: checks, allocation and dispatch; the kernel is in kernels/lora.cu ([Torch-free
// kernels] in kernels/launch.h).
#include "kernels/lora.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/cuda_types.h"
#include "kernels/device_guard.h"
#include "kernels/lora_launch.h"

namespace symbiosis::kernels {
namespace {

void check_members(const at::Tensor& t, const std::vector<LoraMember>& members, int64_t columns, int64_t rank_total) {
  TORCH_CHECK(!members.empty() && members.size() <= kLoraMaxMembers, "lora_expand: takes 1 to ", kLoraMaxMembers,
              " members, got ", members.size());
  TORCH_CHECK(rank_total <= kLoraMaxRankTotal, "lora_expand: the members' ranks add up to ", rank_total, ", at most ",
              kLoraMaxRankTotal, " expected");
  for (const auto& m : members) {
    TORCH_CHECK(m.b.defined() && m.b.dim() == 2 && m.b.is_contiguous() && m.b.size(0) == m.width &&
                    m.b.scalar_type() == t.scalar_type() && m.b.device() == t.device(),
                "lora_expand: a member's B must be [", m.width, ", rank] contiguous in ", t.scalar_type(), " on ",
                t.device(), ", got ", m.b.sizes(), " in ", m.b.scalar_type());
    TORCH_CHECK(
        m.column >= 0 && m.column + m.width <= columns && m.h_column >= 0 && m.h_column + m.b.size(1) <= rank_total,
        "lora_expand: a member's columns [", m.column, ", ", m.column + m.width, ") or rank columns [", m.h_column,
        ", ", m.h_column + m.b.size(1), ") lie outside [0, ", columns, ") and [0, ", rank_total, ")");
  }
}

// scalar_t: ATen's element type.
template <typename scalar_t>
device::LoraMembers<cuda_type_t<scalar_t>> pack(const std::vector<LoraMember>& members) {
  device::LoraMembers<cuda_type_t<scalar_t>> packed{};
  packed.count = static_cast<int>(members.size());
  for (size_t i = 0; i < members.size(); ++i) {
    packed.column[i] = members[i].column;
    packed.width[i] = members[i].width;
    packed.rank[i] = static_cast<int>(members[i].b.size(1));
    packed.h_column[i] = static_cast<int>(members[i].h_column);
    packed.scaling[i] = static_cast<float>(members[i].scaling);
    packed.b[i] = cuda_data<scalar_t>(members[i].b);
  }
  return packed;
}

}  // namespace

at::Tensor lora_expand(const at::Tensor& base, const at::Tensor& h, const std::vector<LoraMember>& members) {
  const auto device_guard = on_device_of(base);  // [Operands' device]
  TORCH_CHECK(base.is_cuda() && base.dim() == 2 && base.stride(1) == 1 && at::isFloatingType(base.scalar_type()),
              "lora_expand: base must be a 2-D floating CUDA tensor with its last dimension contiguous, got ",
              base.sizes(), " with strides ", base.strides(), " on ", base.device());
  TORCH_CHECK(h.is_contiguous() && h.dim() == 2 && h.size(0) == base.size(0) && h.scalar_type() == base.scalar_type() &&
                  h.device() == base.device(),
              "lora_expand: h must be [", base.size(0), ", rank] contiguous in ", base.scalar_type(), ", got ",
              h.sizes(), " in ", h.scalar_type());
  check_members(base, members, base.size(1), h.size(1));
  auto out = at::empty(base.sizes(), base.options());
  if (base.numel() == 0) return out;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, base.scalar_type(), "lora_expand", [&] {
    C10_CUDA_CHECK(device::lora_expand(cuda_data<scalar_t>(base), base.stride(0), cuda_data<scalar_t>(h), h.size(1),
                                       cuda_data<scalar_t>(out), base.size(0), base.size(1), pack<scalar_t>(members),
                                       stream));
  });
  return out;
}

}  // namespace symbiosis::kernels
