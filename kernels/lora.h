#pragma once
// [Grouped LoRA]
// LoRA's update of a layer's full width, for several adapted layers that read one input and whose
// base outputs lie side by side (a layer group: q, k and v; gate and up), in one kernel:
// out = base + [h_m·B_mᵀ·s_m] in each member m's columns (base's elsewhere), where
// h = x·[A_1; A_2; ...]ᵀ holds the members' rank columns side by side. Left to ATen, each adapter
// costs a product and a scaled add: at 1 x 128 tokens, kernels of 2-4 us each, and LoRA was over
// half of a Llama-3.2-1B client's ~1 100 kernels a step (docs/benchmarks-history.md). Each output
// is a dot of rank terms, accumulated in fp32 and rounded once with base, so results match the
// expression within the dtype's rounding, not bit for bit. Built only with CUDA;
// client_runtime/peft/lora.cpp calls it on a GPU, and computes the rest of the group's products
// with cuBLAS.
#include <ATen/ATen.h>

#include <vector>

#include "kernels/lora_launch.h"  // kLoraMaxMembers, kLoraMaxRankTotal

namespace symbiosis::kernels {

// One adapted member of a group: its columns [column, column + width) of the stacked output, its
// B [width, rank] (contiguous, the dtype of base), its rank columns [h_column, h_column + rank) of
// h, and its scaling.
struct LoraMember {
  int64_t column = 0;
  int64_t width = 0;
  at::Tensor b;
  int64_t h_column = 0;
  double scaling = 1.0;
};

// base: [rows, C] (last dimension contiguous), h: [rows, R] contiguous, both of one floating dtype
// on one GPU; members (1 to kLoraMaxMembers, their ranks adding up to at most kLoraMaxRankTotal)
// disjoint within C and R. Returns out, [rows, C] contiguous.
at::Tensor lora_expand(const at::Tensor& base, const at::Tensor& h, const std::vector<LoraMember>& members);

}  // namespace symbiosis::kernels
