#pragma once
// [Grouped LoRA]'s kernel, without LibTorch ([Torch-free kernels] in kernels/launch.h); callers use
// kernels/lora.h.
#include <cstdint>

#include "kernels/launch.h"

namespace symbiosis::kernels {

constexpr int kLoraMaxMembers = 4;
constexpr int64_t kLoraMaxRankTotal = 256;  // the members' ranks added up

namespace device {

// A group's members (kernels/lora.h's LoraMember) as the kernel takes them.
template <typename T>
struct LoraMembers {
  int count;
  int64_t column[kLoraMaxMembers], width[kLoraMaxMembers];
  int rank[kLoraMaxMembers], h_column[kLoraMaxMembers];
  float scaling[kLoraMaxMembers];
  const T* b[kLoraMaxMembers];
};

// out [rows, columns] (contiguous) = base (rows base_row_stride apart) + each member's h·Bᵀ·scaling
// in its columns, h [rows, rank_total] contiguous, on `stream`.
template <typename T>
cudaError_t lora_expand(const T* base, int64_t base_row_stride, const T* h, int64_t rank_total, T* out, int64_t rows,
                        int64_t columns, const LoraMembers<T>& members, cudaStream_t stream);

}  // namespace device
}  // namespace symbiosis::kernels
