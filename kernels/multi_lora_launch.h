#pragma once
// [Multi-LoRA kernel]'s launches, without LibTorch ([Torch-free kernels] in kernels/launch.h);
// callers use kernels/multi_lora.h.
#include <cstdint>

#include "kernels/launch.h"

namespace symbiosis::kernels {

constexpr int64_t kMultiLoraMaxRank = 512;  // the widest rank a slot may have

namespace device {

// One slot of a layer's adapter table, in device memory: A [rank, in] and B [out, rank], both
// contiguous in the layer's dtype; rank 0: the slot holds no adapter for this layer.
struct MultiLoraSlot {
  const void* a;
  const void* b;
  int32_t rank;
  float scaling;
};

// out [rows, columns] (contiguous) = base (rows base_row_stride apart) + for each row i whose
// slots[i] is in [0, slot_count) and whose slot has a rank, x_i·Aᵀ·Bᵀ·scaling of that slot, in
// fp32 (h [rows, max_rank] fp32 is scratch); other rows are base's. x: [rows, in] contiguous. Two
// launches (shrink, expand) for every slot at once, on `stream`.
template <typename T>
cudaError_t multi_lora(const T* base, int64_t base_row_stride, const T* x, int64_t in, const int32_t* slots,
                       const MultiLoraSlot* table, int32_t slot_count, float* h, int64_t max_rank, T* out, int64_t rows,
                       int64_t columns, cudaStream_t stream);

}  // namespace device
}  // namespace symbiosis::kernels
