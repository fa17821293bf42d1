#pragma once
// [Fused noise masking]
// A masked call's two sides on a GPU ([Noise masking] in privacy/noise_mask.h), each one kernel,
// one block a row:
//  - mask: the row's choice of bank rows ([Noise choice]) from the call's number, which the kernel
//    reads from device memory, so that a replayed CUDA graph masks with a new choice each time; the
//    row's noise, the signed sum of its chosen rows over √mix; and x + s·noise, in fp32, rounded
//    once to x's dtype, with s = ratio × RMS(x) read from the GPU (one reduction before it, no host
//    sync);
//  - unmask: y - s·(the same combination of the rows' effects) + bias, in fp32, rounded once; it
//    advances the call's number, after every block of the mask has read it.
// Left to ATen the same takes two gathers, a sum and a few elementwise kernels each way, which at a
// decode step's few rows cost more than the call. Rows whose addresses and strides
// allow it go 16 bytes a thread at a time. Results match the expression within the dtype's
// rounding. Built only with CUDA; privacy/noise_mask.cpp calls them for a client on a GPU.
#include <ATen/ATen.h>

#include <cstdint>

namespace symbiosis::kernels {

struct MaskedRows {
  at::Tensor masked;   // x + s·noise, x's shape and dtype
  at::Tensor choices;  // [rows, mix] int32: bank row + 1, negated for a minus sign
  at::Tensor norm;     // [] fp32: ‖x‖, on x's device
  double factor = 0;   // s = factor × norm (ratio / √x.numel())
};

// x: [rows, features] on a GPU (fp32, bf16 or fp16), its rows contiguous; bank: [bank_rows,
// features] of x's dtype and device, contiguous; call: int64 [1] on x's device, the call's number
// (read here, advanced by unmask_rows); 1 <= mix <= kMaxNoiseMix.
MaskedRows mask_rows(const at::Tensor& x, const at::Tensor& bank, const at::Tensor& call, uint64_t secret, int64_t mix,
                     double ratio);

// y: [rows, out] (the executor's result for `masked`, in x's dtype) on x's GPU, its rows
// contiguous; effect: [bank_rows, out] of y's dtype, contiguous; bias: [out] fp32 or undefined;
// call: as given to mask_rows, which this advances by one. Returns y - s·effects + bias, [rows, out]
// in y's dtype.
at::Tensor unmask_rows(const at::Tensor& y, const at::Tensor& effect, const MaskedRows& masked, const at::Tensor& bias,
                       const at::Tensor& call);

}  // namespace symbiosis::kernels
