#pragma once
// AdamW (decoupled weight decay, as torch::optim::AdamW and torch.optim.AdamW compute it) that
// updates all of its parameters with one fused kernel per device and dtype (LibTorch's
// _fused_adamw_, what torch.optim.AdamW(fused=True) runs). torch::optim::AdamW launches about ten
// kernels per parameter, which for the hundreds of adapter tensors of a LoRA model is most of a
// small training step's time on a GPU. Optimizer state (step, exp_avg, exp_avg_sq) lives beside
// each parameter, in its dtype.
#include <ATen/ATen.h>

#include <vector>

namespace symbiosis {

struct FusedAdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
};

class FusedAdamW {
 public:
  explicit FusedAdamW(std::vector<at::Tensor> params, FusedAdamWOptions options = {});
  void zero_grad();  // drops the gradients (set to none)
  void step();       // parameters without a gradient are left alone
  void set_lr(double lr) { options_.lr = lr; }
  // The learning rate read from a one-element fp32 tensor on the parameters' device at every step
  // instead of options.lr: a captured step reads whatever was written into it before the replay.
  void set_lr_tensor(at::Tensor lr) { lr_tensor_ = std::move(lr); }

  // The optimizer's state (per parameter: exp_avg, exp_avg_sq, step), in parameter order, for
  // checkpoints; load_state copies saved values into it (the tensors themselves stay: a captured
  // step keeps using them).
  std::vector<at::Tensor> state() const;
  void load_state(const std::vector<at::Tensor>& saved);

 private:
  FusedAdamWOptions options_;
  std::vector<at::Tensor> params_, exp_avg_, exp_avg_sq_, steps_;
  at::Tensor lr_tensor_;  // undefined: options_.lr
};

}  // namespace symbiosis
