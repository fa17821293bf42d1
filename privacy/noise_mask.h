#pragma once
// [Noise masking] (the paper's section 3.8)
// A private tenant's base-layer calls carry its activations and gradients masked with noise only
// it knows, and it takes the noise's effect off what comes back, so the result is what it would
// have been unmasked:
//  - per layer and direction (forward, backward) a bank of `bank_rows` noise rows, drawn from the
//    tenant's secret; the executor computes each row's effect once, n·Wᵀ (FORWARD_NO_BIAS) forward
//    and m·W (BACKWARD_INPUT) backward, and the tenant keeps them in the call's dtype, as the
//    executor's results are;
//  - each of a call's T rows gets noise n that sums `mix` bank rows of unit variance with random
//    signs, over √mix (secretly, anew for every call, from the call's number: [Noise choice] in
//    kernels/noise_choice.h; bank_rows^mix × 2^mix combinations, so two rows rarely share their
//    noise, whose difference would show the difference of their inputs), scaled by
//    s = noise_ratio × the call's RMS (activations and gradients differ in scale by orders of
//    magnitude: noise of one fixed scale would drown gradients in rounding; one scale for the
//    call, not one a row, so that a masked row's norm, mostly noise, hides the row's own: a row of
//    zeros goes as noise like any other) and sends x + s·n;
//    from the result it subtracts s × the rows' effects in fp32 (W is linear), and adds the
//    layer's bias itself (the bias is the executor's FORWARD of a zero row, asked once: public base
//    weights); on a GPU each side is one kernel ([Fused noise masking] in kernels/noise_mask.h);
//  - after `rotate_after` calls of a layer and direction, or when rotate() asks, its bank is drawn
//    anew, into the same memory.
// What the executor sees: every bank row alone once (it computes its effect) unless the tenant
// computes the effects itself from the public base weights (effects_checkpoint), then only masked
// rows, whose norms tell it each call's input RMS within the noise's spread. It never sees the
// adapter, which stays in the tenant's process. docs/privacy.md states the threat model and what
// masking does not protect.
//
// [Masked captures]
// A masked client's steps can be captured in CUDA graphs (StepGraph, the Generator's decode): on a
// GPU the call's number lives in device memory, read by the mask kernel and advanced by the unmask
// kernel, so every replay masks with a new choice of rows, and the scale is computed on the GPU
// from the replayed input. A bank is drawn in an eager step (its first use; rotating inside a
// capture would record the executor's call, not make it), and redrawn in place, so a graph reads
// the new bank where it read the old. Between begin_capture() and end_capture() the mask counts
// each bank's calls in the capture; replayed() adds them once per replay and redraws the banks
// then due.
// Thread-safe: autograd may call backward from another thread.
#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "common/layer_info.h"

namespace symbiosis {

struct PrivacyOptions {
  bool mask = false;         // mask this client's activations and gradients
  uint64_t secret = 0;       // seeds the banks and the choice of rows; 0: drawn from the system
  int64_t bank_rows = 256;   // noise rows per layer and direction
  int64_t mix = 2;           // bank rows summed (with random signs) into each row's noise
  double noise_ratio = 4.0;  // the noise's norm against the masked call's input's (per call)
  int64_t rotate_after = 0;  // calls of a layer and direction after which its bank is drawn anew; 0: never
  // "": the executor computes the banks' effects (it sees each bank row alone, once). A checkpoint
  // directory of the executor's model: this process computes them from the public base weights,
  // streamed layer by layer when a bank is drawn, so the executor never sees a noise row alone.
  std::string effects_checkpoint;

  void validate() const;  // throws naming the field and its range
};

class NoiseMask {
 public:
  enum class Op { kForward, kForwardNoBias, kBackwardInput };
  // Sends one call of `layer` to the executor and returns its result.
  using Send = std::function<at::Tensor(Op op, const at::Tensor& x)>;
  // A layer's (or group's) weight [out, in] and bias [out] (undefined without one), in fp32, as the
  // executor computes with them: where effects are computed here (effects_checkpoint).
  struct Weights {
    at::Tensor weight, bias;
  };
  using LoadWeights = std::function<Weights(const LayerInfo& layer)>;
  // A layer's way to the executor, for banks redrawn when a capture is replayed.
  using SendFor = std::function<Send(const LayerInfo& layer)>;
  // [Masked captures]: the banks a capture's calls use, (layer id, backward), and their calls.
  using BankKey = std::pair<uint32_t, bool>;
  using CapturedUse = std::map<BankKey, int64_t>;

  // load_weights: given exactly when options.effects_checkpoint is.
  explicit NoiseMask(const PrivacyOptions& options, LoadWeights load_weights = {});

  // x·Wᵀ (+ bias), computed by `send` on x masked.
  at::Tensor forward(const LayerInfo& layer, const at::Tensor& x, bool with_bias, const Send& send);
  // grad_out·W, computed by `send` on grad_out masked.
  at::Tensor backward_input(const LayerInfo& layer, const at::Tensor& grad_out, const Send& send);
  // [Masked captures]: from begin_capture() to end_capture() the calls are being captured; a bank
  // first used then is refused (draw it in an eager step first). replayed() counts one replay.
  void begin_capture();
  CapturedUse end_capture();
  void replayed(const CapturedUse& use, const SendFor& send_for);
  // Draws every bank anew at its next use (or the next replay that uses it).
  void rotate();
  // Banks drawn so far, rotations included (each cost the executor one call), and banks held now
  // (one per layer and direction used).
  int64_t banks_drawn() const;
  int64_t banks_held() const;

 private:
  struct Bank {
    const LayerInfo* layer = nullptr;  // the client's, which outlives the mask
    at::Tensor noise;                  // [bank_rows, features], in the call's dtype and device
    at::Tensor effect;                 // [bank_rows, out features], in the call's dtype
    int64_t calls = 0;                 // since drawn
    bool rotate = false;               // asked by rotate()
    bool due(int64_t rotate_after) const { return rotate || (rotate_after > 0 && calls >= rotate_after); }
  };
  // The bank of (layer, direction) for a call like `like`, drawn (and its effect computed) when
  // missing or due.
  Bank& bank(const LayerInfo& layer, bool backward, const at::Tensor& like, const Send& send);
  // Draws `bank`'s rows and their effects: in place where it has rows of that shape, dtype and device.
  void draw(Bank& bank, bool backward, const at::TensorOptions& like, const Send& send);
  // The layer's bias in fp32 on x's device (public: from the checkpoint, or asked once).
  const at::Tensor& bias(const LayerInfo& layer, const at::Tensor& x, const Send& send);
  // Masks x with rows of `bank`, sends it as `op` and takes the rows' effect off the result (adding
  // `bias` where defined) in fp32; returns x's dtype.
  at::Tensor masked_call(Bank& bank, Op op, const at::Tensor& x, const at::Tensor& bias, const Send& send);

  const PrivacyOptions options_;
  const LoadWeights load_weights_;
  const uint64_t secret_;
  mutable std::mutex mutex_;                          // guards everything below
  at::Generator noise_;                               // the banks' values (CPU), seeded from the secret
  uint64_t cpu_calls_ = 0;                            // the next CPU call's number ([Noise choice])
  std::map<c10::DeviceIndex, at::Tensor> gpu_calls_;  // the next GPU call's number, int64 [1] on that GPU
  std::map<BankKey, Bank> banks_;
  std::map<uint32_t, at::Tensor> biases_;  // fp32 [out features] on the calls' device, by layer id
  int64_t banks_drawn_ = 0;
  bool capturing_ = false;
  CapturedUse captured_;  // while capturing
};

}  // namespace symbiosis
