#include "privacy/noise_mask.h"

#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <random>
#include <vector>

#include "kernels/noise_choice.h"

#ifdef SYMBIOSIS_WITH_CUDA
#include "kernels/noise_mask.h"
#endif

namespace symbiosis {

void PrivacyOptions::validate() const {
  TORCH_CHECK(bank_rows >= 1 && bank_rows <= (int64_t{1} << 30), "privacy option bank_rows must be in [1, 2^30], got ",
              bank_rows);
  TORCH_CHECK(mix >= 1 && mix <= kMaxNoiseMix, "privacy option mix must be in [1, ", kMaxNoiseMix, "], got ", mix);
  TORCH_CHECK(noise_ratio > 0, "privacy option noise_ratio must be positive, got ", noise_ratio);
  TORCH_CHECK(rotate_after >= 0, "privacy option rotate_after must be >= 0 (0: never), got ", rotate_after);
}

namespace {

uint64_t secret_or_random(uint64_t secret) {
  if (secret != 0) return secret;
  std::random_device device;
  return (uint64_t{device()} << 32) ^ device();
}

// [Masked captures]: what a layer needs from the executor before its first masked call (a bank's
// effects, its bias) cannot be asked inside a capture, which records calls rather than making them.
[[noreturn]] void refuse_first_call_in_capture(const LayerInfo& layer, const char* what) {
  TORCH_CHECK(false, "privacy masking: layer '", layer.name, "' is first called inside a CUDA graph capture, and ",
              what,
              " needs an executor call, which a capture records instead of making; run the step eagerly at "
              "least once before capturing it");
}

}  // namespace

NoiseMask::NoiseMask(const PrivacyOptions& options, LoadWeights load_weights)
    : options_(options), load_weights_(std::move(load_weights)), secret_(secret_or_random(options.secret)) {
  options_.validate();
  TORCH_CHECK(options_.effects_checkpoint.empty() == !load_weights_,
              "internal: NoiseMask takes the base weights exactly when effects_checkpoint is given");
  // Two streams from one secret: the banks' values (here) and the choice of rows ([Noise choice],
  // keyed by the secret itself).
  noise_ = at::make_generator<at::CPUGeneratorImpl>(secret_ ^ 0x9e3779b97f4a7c15ull);
}

int64_t NoiseMask::banks_drawn() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return banks_drawn_;
}

int64_t NoiseMask::banks_held() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int64_t>(banks_.size());
}

void NoiseMask::draw(Bank& bank, bool backward, const at::TensorOptions& like, const Send& send) {
  const LayerInfo& layer = *bank.layer;
  const int64_t features = backward ? layer.out_features : layer.in_features;
  // Drawn on the CPU from the secret's stream (the same on every device), in the call's dtype, so
  // that the rows sent and the rows whose effect is computed are the same numbers.
  const auto noise =
      at::normal(0.0, 1.0, {options_.bank_rows, features}, noise_, at::TensorOptions().dtype(at::kFloat)).to(like);
  at::Tensor effect;
  if (load_weights_) {
    // Here, in fp32, from the weights as the executor holds them: the executor never sees the rows.
    const auto weights = load_weights_(layer);
    const auto weight = weights.weight.to(like.device());
    effect = backward ? at::mm(noise.to(at::kFloat), weight) : at::mm(noise.to(at::kFloat), weight.t());
    if (weights.bias.defined() && !biases_.count(layer.id)) biases_[layer.id] = weights.bias.to(like.device());
  } else {
    effect = send(backward ? Op::kBackwardInput : Op::kForwardNoBias, noise);
  }
  // Kept in the call's dtype, as the executor's results are: the subtraction is in fp32.
  effect = effect.to(like.dtype());
  if (bank.noise.defined() && bank.noise.sizes() == noise.sizes() && bank.noise.device() == noise.device() &&
      bank.noise.scalar_type() == noise.scalar_type()) {
    // [Masked captures]: in place, where a captured graph reads it.
    bank.noise.copy_(noise);
    bank.effect.copy_(effect);
  } else {
    bank.noise = noise;
    bank.effect = effect.contiguous();
  }
  bank.calls = 0;
  bank.rotate = false;
  banks_drawn_++;
}

NoiseMask::Bank& NoiseMask::bank(const LayerInfo& layer, bool backward, const at::Tensor& like, const Send& send) {
  auto& bank = banks_[{layer.id, backward}];
  bank.layer = &layer;
  const bool fits =
      bank.noise.defined() && bank.noise.device() == like.device() && bank.noise.scalar_type() == like.scalar_type();
  if (capturing_) {
    if (!fits) refuse_first_call_in_capture(layer, backward ? "its backward noise bank" : "its forward noise bank");
    return bank;  // a bank due now is redrawn when a replay counts its calls
  }
  if (!fits || bank.due(options_.rotate_after)) draw(bank, backward, like.options(), send);
  return bank;
}

const at::Tensor& NoiseMask::bias(const LayerInfo& layer, const at::Tensor& x, const Send& send) {
  // A public base weight: read from the checkpoint with the bank's weights, or the executor's
  // FORWARD of a zero row, asked once.
  auto& bias = biases_[layer.id];
  if (!bias.defined()) {
    if (capturing_) refuse_first_call_in_capture(layer, "its bias");
    bias = send(Op::kForward, at::zeros({1, layer.in_features}, x.options())).to(at::kFloat)[0].contiguous();
  }
  return bias;
}

at::Tensor NoiseMask::masked_call(Bank& bank, Op op, const at::Tensor& x, const at::Tensor& bias, const Send& send) {
  if (capturing_) {
    captured_[{bank.layer->id, op == Op::kBackwardInput}]++;
  } else {
    bank.calls++;
  }
#ifdef SYMBIOSIS_WITH_CUDA
  if (x.is_cuda()) {
    // [Fused noise masking]: the call's number is read and advanced on the GPU ([Masked captures]).
    auto& number = gpu_calls_[x.device().index()];
    if (!number.defined()) number = at::zeros({1}, x.options().dtype(at::kLong));
    const auto masked = kernels::mask_rows(x.stride(-1) == 1 ? x : x.contiguous(), bank.noise, number, secret_,
                                           options_.mix, options_.noise_ratio);
    return kernels::unmask_rows(send(op, masked.masked), bank.effect, masked, bias, number);
  }
#endif
  TORCH_CHECK(x.is_cpu(), "privacy masking: a call on ", x.device(), " needs the CUDA kernels, which this build lacks");
  const int64_t rows = x.size(0), mix = options_.mix;
  // [Noise choice] of each row, as [mix, rows] bank rows and signs.
  auto index = at::empty({mix, rows}, at::kLong);
  auto sign = at::empty({mix, rows, 1}, at::kFloat);
  auto* index_data = index.data_ptr<int64_t>();
  auto* sign_data = sign.data_ptr<float>();
  const uint64_t call = cpu_calls_++;
  for (int64_t row = 0; row < rows; ++row) {
    int64_t row_index[kMaxNoiseMix];
    float row_sign[kMaxNoiseMix];
    noise_choice(secret_, call, static_cast<uint64_t>(row), options_.bank_rows, static_cast<int>(mix), row_index,
                 row_sign);
    for (int64_t j = 0; j < mix; ++j) {
      index_data[j * rows + row] = row_index[j];
      sign_data[j * rows + row] = row_sign[j];
    }
  }
  index = index.view({-1});
  // noise and effect, each [rows, features] in fp32: the signed sum of the chosen rows over √mix.
  auto mixed = [&](const at::Tensor& table) {
    return (table.index_select(0, index).to(at::kFloat).view({mix, rows, -1}) * sign).sum(0) /
           std::sqrt(static_cast<double>(mix));
  };
  const auto x32 = x.to(at::kFloat);
  const auto scale = options_.noise_ratio * x32.square().mean().sqrt();
  const auto masked = (x32 + scale * mixed(bank.noise)).to(x.scalar_type());
  auto out = send(op, masked).to(at::kFloat) - scale * mixed(bank.effect);
  if (bias.defined()) out = out + bias;
  return out.to(x.scalar_type());
}

at::Tensor NoiseMask::forward(const LayerInfo& layer, const at::Tensor& x, bool with_bias, const Send& send) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto& rows = bank(layer, /*backward=*/false, x, send);
  const at::Tensor no_bias;
  return masked_call(rows, Op::kForwardNoBias, x, with_bias && layer.bias ? bias(layer, x, send) : no_bias, send);
}

at::Tensor NoiseMask::backward_input(const LayerInfo& layer, const at::Tensor& grad_out, const Send& send) {
  std::lock_guard<std::mutex> lock(mutex_);
  return masked_call(bank(layer, /*backward=*/true, grad_out, send), Op::kBackwardInput, grad_out, at::Tensor(), send);
}

void NoiseMask::begin_capture() {
  std::lock_guard<std::mutex> lock(mutex_);
  capturing_ = true;
  captured_.clear();
}

NoiseMask::CapturedUse NoiseMask::end_capture() {
  std::lock_guard<std::mutex> lock(mutex_);
  capturing_ = false;
  return std::move(captured_);
}

void NoiseMask::replayed(const CapturedUse& use, const SendFor& send_for) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& [key, calls] : use) {
    auto& bank = banks_.at(key);
    bank.calls += calls;
    if (bank.due(options_.rotate_after)) draw(bank, key.second, bank.noise.options(), send_for(*bank.layer));
  }
}

void NoiseMask::rotate() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& [key, bank] : banks_) bank.rotate = true;
}

}  // namespace symbiosis
