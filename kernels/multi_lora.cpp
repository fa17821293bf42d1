// [Multi-LoRA kernel]: checks, the table, allocation and dispatch; the kernels are in
// kernels/multi_lora.cu ([Torch-free kernels] in kernels/launch.h).
#include "kernels/multi_lora.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <cstring>

#include "kernels/cuda_types.h"
#include "kernels/device_guard.h"

namespace symbiosis::kernels {

int64_t multi_lora_table_bytes(int64_t slots) { return slots * static_cast<int64_t>(sizeof(device::MultiLoraSlot)); }

at::Tensor multi_lora_table(const std::vector<MultiLoraEntry>& entries) {
  auto bytes = at::zeros({multi_lora_table_bytes(static_cast<int64_t>(entries.size()))}, at::kByte);
  auto* table = reinterpret_cast<device::MultiLoraSlot*>(bytes.data_ptr<uint8_t>());
  for (size_t i = 0; i < entries.size(); ++i) {
    const auto& e = entries[i];
    device::MultiLoraSlot slot{nullptr, nullptr, 0, 0.f};
    if (e.a.defined()) {
      TORCH_CHECK(e.a.is_cuda() && e.b.is_cuda() && e.a.dim() == 2 && e.b.dim() == 2 && e.a.is_contiguous() &&
                      e.b.is_contiguous() && e.a.size(0) == e.b.size(1) && e.a.scalar_type() == e.b.scalar_type() &&
                      e.a.size(0) >= 1 && e.a.size(0) <= kMultiLoraMaxRank,
                  "multi_lora_table: slot ", i,
                  " needs A [rank, in] and B [out, rank] contiguous on a GPU in one dtype",
                  " with 1 <= rank <= ", kMultiLoraMaxRank, ", got A ", e.a.sizes(), " and B ", e.b.sizes());
      slot = {e.a.data_ptr(), e.b.data_ptr(), static_cast<int32_t>(e.a.size(0)), static_cast<float>(e.scaling)};
    }
    std::memcpy(table + i, &slot, sizeof(slot));
  }
  return bytes;
}

at::Tensor multi_lora(const at::Tensor& base, const at::Tensor& x, const at::Tensor& slots, const at::Tensor& table,
                      int64_t max_rank) {
  const auto device_guard = on_device_of(base);  // [Operands' device]
  TORCH_CHECK(base.is_cuda() && base.dim() == 2 && base.stride(1) == 1, "multi_lora: base must be a 2-D CUDA tensor",
              " with its last dimension contiguous, got ", base.sizes(), " with strides ", base.strides(), " on ",
              base.device());
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(0) == base.size(0) && x.scalar_type() == base.scalar_type() &&
                  x.device() == base.device(),
              "multi_lora: x must be [", base.size(0), ", in] contiguous in ", base.scalar_type(), " on ",
              base.device(), ", got ", x.sizes(), " in ", x.scalar_type(), " on ", x.device());
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == base.size(0) && slots.scalar_type() == at::kInt &&
                  slots.is_contiguous() && slots.device() == base.device(),
              "multi_lora: slots must be [", base.size(0), "] int32 on ", base.device(), ", got ", slots.sizes(), " ",
              slots.scalar_type(), " on ", slots.device());
  const auto entry = multi_lora_table_bytes(1);
  TORCH_CHECK(table.dim() == 1 && table.scalar_type() == at::kByte && table.device() == base.device() &&
                  table.size(0) % entry == 0 && table.size(0) > 0,
              "multi_lora: table must be a multi_lora_table copied to ", base.device(), ", got ", table.sizes(), " ",
              table.scalar_type(), " on ", table.device());
  TORCH_CHECK(max_rank >= 1 && max_rank <= kMultiLoraMaxRank, "multi_lora: max_rank is ", max_rank, ", expected 1 to ",
              kMultiLoraMaxRank);
  auto out = at::empty(base.sizes(), base.options());
  if (base.numel() == 0) return out;
  auto h = at::empty({base.size(0), max_rank}, base.options().dtype(at::kFloat));
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const bool launched = with_cuda_type(base.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    C10_CUDA_CHECK(device::multi_lora<T>(static_cast<const T*>(base.data_ptr()), base.stride(0),
                                         static_cast<const T*>(x.data_ptr()), x.size(1), slots.data_ptr<int32_t>(),
                                         reinterpret_cast<const device::MultiLoraSlot*>(table.data_ptr<uint8_t>()),
                                         static_cast<int32_t>(table.size(0) / entry), h.data_ptr<float>(), max_rank,
                                         static_cast<T*>(out.data_ptr()), base.size(0), base.size(1), stream));
  });
  TORCH_CHECK(launched, "multi_lora: takes fp32, bf16 or fp16, got ", base.scalar_type());
  return out;
}

}  // namespace symbiosis::kernels
