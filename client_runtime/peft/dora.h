#pragma once
// DoRA (Liu et al. 2024, "Weight-Decomposed Low-Rank Adaptation") on base layers, as Hugging Face
// PEFT computes it (LoraConfig use_dora): the adapted weight W + s·B·A is renormalized per output
// row o to a learned magnitude m_o,
//   y = m/‖W + s·B·A‖ ⊙ (x·Wᵀ + s·x·Aᵀ·Bᵀ) + b,
// written as PEFT writes it: y = base(x) + (m/n − 1)·(base(x) − b) + (m/n)·s·lora(x), with the
// norm n detached from autograd (DoRA §4.3). Saved with LoRA's keys plus
// base_model.model.<layer>.lora_magnitude_vector [out].
//
// [DoRA norms on the executor]
// A virtual layer's W lives on the executor, so the client cannot form W + s·B·A. With M the
// layer's map x ↦ x·M (M = Wᵀ for Linear, W for Conv1D, so both kinds are handled alike):
//   n_o² = ‖M[:,o]‖² + 2s·Σ_j B[o,j]·(A·M)[j,o] + s²·B_o·(A·Aᵀ)·B_oᵀ.
// ‖M[:,o]‖² is found once by streaming chunks of the identity through FORWARD_NO_BIAS (I·M gives
// rows of M; squares are summed over chunks, so all of W is never held) and cached with the bias
// (one FORWARD on a zero row). Each forward then costs one FORWARD_NO_BIAS on A's r rows. A local
// (monolithic) layer evaluates the same expansion with ‖M[:,o]‖² summed from its weights, so split
// and monolithic runs round alike (PEFT's direct ‖W + s·B·A‖ differs from it by rounding only; the
// interop tests compare the two). The sum is taken in double: its terms may nearly cancel.
#include "client_runtime/peft/lora.h"

namespace symbiosis {

class DoraAdapterImpl : public LoraAdapterImpl {
 public:
  DoraAdapterImpl(int64_t in_features, int64_t out_features, const LoraConfig& config);
  // Keeps the layer; sets the magnitude to the weight norm (PEFT's initialization) when the base
  // can be computed now, else at the first forward (unless loaded before).
  void attach(nn::BaseLayerImpl* layer) override;
  at::Tensor forward(const at::Tensor& x, const BaseFn& base) override;

  // ‖W_o + s·(B·A)_o‖ for every output row o, [out], without autograd.
  at::Tensor weight_norm();
  // Marks the magnitude as set (by a load), so it is not initialized from the weights.
  void set_magnitude_loaded() { magnitude_ready_ = true; }

  at::Tensor lora_magnitude_vector;  // [out]

 private:
  void ensure_magnitude();
  // ‖M[:,o]‖² of the virtual layer, in double, and its bias; computed once per binding.
  void cache_virtual_base();

  nn::BaseLayerImpl* layer_ = nullptr;  // the layer holding this adapter (it owns us)
  bool magnitude_ready_ = false;
  const void* cached_binding_ = nullptr;  // the VirtLayer the caches below belong to
  at::Tensor base_column_norms_sq_;       // [out], double
  at::Tensor base_bias_;                  // [out] or undefined
};

}  // namespace symbiosis
