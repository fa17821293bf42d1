#pragma once
// [Multi-LoRA kernel]
// Each row of a layer's input with its own LoRA adapter, all adapters of the layer at once, as
// Punica's BGMV/SGMV and S-LoRA's kernels do (../shared/papers/punica.txt, s-lora.txt): row i adds
// x_i·A_sᵀ·B_sᵀ·scaling_s for its slot s = slots[i] (-1, or a slot without this layer: base alone).
// Rows of one slot need not be adjacent, so one form serves prefill (a sequence's rows in a
// segment, SGMV) and decode (one row a sequence, BGMV). The adapters are a table in device memory
// of each slot's A and B pointers, rank and scaling; slots and table are read on the device, so a
// step captured in a CUDA graph applies whatever adapters the table and the slots hold at each
// replay. Two launches for the whole layer: a shrink (h = x·Aᵀ per row, fp32) and an expand
// (base + scaling·h·Bᵀ, accumulated in fp32 and rounded once), so results match the plain loop
// within the dtype's rounding, not bit for bit. Built only with CUDA; client_runtime/peft/lora_bank.cpp
// calls it on a GPU ([Multi-adapter batches]).
#include <ATen/ATen.h>

#include <vector>

#include "kernels/multi_lora_launch.h"  // kMultiLoraMaxRank

namespace symbiosis::kernels {

// A slot's adapter for one layer: A [rank, in] and B [out, rank], contiguous, on the GPU in the
// layer's dtype; undefined a: the slot has no adapter for this layer.
struct MultiLoraEntry {
  at::Tensor a;
  at::Tensor b;
  double scaling = 1.0;
};

// The table of `entries` (slot by slot) as bytes on the host, to be copied into the device tensor
// multi_lora reads (its size: multi_lora_table_bytes(entries.size())). The tensors must outlive
// every use of the table.
at::Tensor multi_lora_table(const std::vector<MultiLoraEntry>& entries);
int64_t multi_lora_table_bytes(int64_t slots);

// base: [rows, out] (last dimension contiguous), x: [rows, in] contiguous, both of one dtype (fp32,
// bf16, fp16) on one GPU; slots: [rows] int32 there; table: a uint8 tensor there holding a
// multi_lora_table; max_rank: at least every entry's rank, at most kMultiLoraMaxRank. Returns out,
// [rows, out] contiguous.
at::Tensor multi_lora(const at::Tensor& base, const at::Tensor& x, const at::Tensor& slots, const at::Tensor& table,
                      int64_t max_rank);

}  // namespace symbiosis::kernels
