#include "privacy/noise_mask.h"

#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <vector>

namespace symbiosis {

void PrivacyOptions::validate() const {
  TORCH_CHECK(bank_rows >= 1, "privacy option bank_rows must be at least 1, got ", bank_rows);
  TORCH_CHECK(mix >= 1 && mix <= 8, "privacy option mix must be in [1, 8], got ", mix);
  TORCH_CHECK(noise_ratio > 0, "privacy option noise_ratio must be positive, got ", noise_ratio);
  TORCH_CHECK(rotate_after >= 0, "privacy option rotate_after must be >= 0 (0: never), got ", rotate_after);
}

namespace {

uint64_t secret_or_random(uint64_t secret) {
  if (secret != 0) return secret;
  std::random_device device;
  return (uint64_t{device()} << 32) ^ device();
}

}  // namespace

NoiseMask::NoiseMask(const PrivacyOptions& options, LoadWeights load_weights)
    : options_(options), load_weights_(std::move(load_weights)) {
  options_.validate();
  TORCH_CHECK(options_.effects_checkpoint.empty() == !load_weights_,
              "internal: NoiseMask takes the base weights exactly when effects_checkpoint is given");
  const uint64_t secret = secret_or_random(options.secret);
  // Two streams from one secret: the banks' values and the choice of rows.
  choice_.seed(secret ^ 0x9e3779b97f4a7c15ull);
  noise_ = at::make_generator<at::CPUGeneratorImpl>(secret);
}

int64_t NoiseMask::banks_drawn() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return banks_drawn_;
}

int64_t NoiseMask::banks_held() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int64_t>(banks_.size());
}

NoiseMask::Bank& NoiseMask::bank(const LayerInfo& layer, bool backward, const at::Tensor& like, const Send& send) {
  auto& bank = banks_[{layer.id, backward}];
  const bool due = options_.rotate_after > 0 && bank.calls >= options_.rotate_after;
  if (bank.noise.defined() && !due && bank.noise.device() == like.device() &&
      bank.noise.scalar_type() == like.scalar_type()) {
    return bank;
  }
  const int64_t features = backward ? layer.out_features : layer.in_features;
  // Drawn on the CPU from the secret's stream (the same on every device), in the call's dtype, so
  // that the rows sent and the rows whose effect is asked are the same numbers.
  const auto noise = at::normal(0.0, 1.0, {options_.bank_rows, features}, noise_, at::TensorOptions().dtype(at::kFloat));
  bank.noise = noise.to(like.options());
  if (load_weights_) {
    // Here, in fp32, from the weights as the executor holds them: the executor never sees the rows.
    const auto weights = load_weights_(layer);
    const auto weight = weights.weight.to(like.device());
    const auto rows = bank.noise.to(at::kFloat);
    bank.effect = backward ? at::mm(rows, weight) : at::mm(rows, weight.t());
    if (weights.bias.defined()) biases_[layer.id] = weights.bias.to(like.device());
  } else {
    bank.effect = send(backward ? Op::kBackwardInput : Op::kForwardNoBias, bank.noise).to(at::kFloat);
  }
  bank.calls = 0;
  banks_drawn_++;
  return bank;
}

at::Tensor NoiseMask::masked_call(Bank& bank, Op op, const at::Tensor& x, const Send& send) {
  const int64_t rows = x.size(0);
  // For each of the `mix` terms, each row's bank row and sign, as 2 × row + (1 for +, 0 for -): one
  // pinned buffer, copied without waiting (this runs at every base-layer call).
  const auto choices = at::empty({options_.mix * rows}, at::TensorOptions().dtype(at::kLong).pinned_memory(x.is_cuda()));
  auto* choice = choices.data_ptr<int64_t>();
  std::uniform_int_distribution<int64_t> pick(0, options_.bank_rows - 1);
  for (int64_t i = 0; i < choices.numel(); ++i) choice[i] = 2 * pick(choice_) + static_cast<int64_t>(choice_() & 1);
  const auto on_device = choices.to(x.device(), /*non_blocking=*/true);
  const auto index = at::floor_divide(on_device, 2);
  const auto sign = (at::remainder(on_device, 2) * 2 - 1).to(at::kFloat).view({options_.mix, rows, 1});
  bank.calls++;
  // noise and effect, each [rows, features] in fp32: the signed sum of the chosen rows over √mix.
  auto mixed = [&](const at::Tensor& table) {
    return (table.index_select(0, index).to(at::kFloat).view({options_.mix, rows, -1}) * sign).sum(0) /
           std::sqrt(static_cast<double>(options_.mix));
  };
  const auto x32 = x.to(at::kFloat);
  const auto scale = options_.noise_ratio * x32.square().mean().sqrt();  // on x's device: no host sync
  const auto masked = (x32 + scale * mixed(bank.noise)).to(x.scalar_type());
  return send(op, masked).to(at::kFloat) - scale * mixed(bank.effect);
}

at::Tensor NoiseMask::forward(const LayerInfo& layer, const at::Tensor& x, bool with_bias, const Send& send) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto out = masked_call(bank(layer, /*backward=*/false, x, send), Op::kForwardNoBias, x, send);
  if (with_bias && layer.bias) {
    // A public base weight: read from the checkpoint with the bank's weights, or the executor's
    // FORWARD of a zero row, asked once.
    auto& bias = biases_[layer.id];
    if (!bias.defined()) bias = send(Op::kForward, at::zeros({1, layer.in_features}, x.options())).to(at::kFloat)[0];
    out = out + bias;
  }
  return out.to(x.scalar_type());
}

at::Tensor NoiseMask::backward_input(const LayerInfo& layer, const at::Tensor& grad_out, const Send& send) {
  std::lock_guard<std::mutex> lock(mutex_);
  return masked_call(bank(layer, /*backward=*/true, grad_out, send), Op::kBackwardInput, grad_out, send)
      .to(grad_out.scalar_type());
}

}  // namespace symbiosis
