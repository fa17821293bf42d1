#include "client_runtime/training/fused_adamw.h"

#include <ATen/ops/_fused_adamw.h>
#include <c10/core/GradMode.h>

#include <map>
#include <tuple>

namespace symbiosis {

FusedAdamW::FusedAdamW(std::vector<at::Tensor> params, FusedAdamWOptions options)
    : options_(options), params_(std::move(params)) {
  TORCH_CHECK(options_.lr >= 0 && options_.eps >= 0 && options_.weight_decay >= 0, "FusedAdamW: lr, eps and ",
              "weight_decay must be >= 0");
  TORCH_CHECK(options_.beta1 >= 0 && options_.beta1 < 1 && options_.beta2 >= 0 && options_.beta2 < 1,
              "FusedAdamW: betas must be in [0, 1)");
  for (const auto& p : params_) {
    TORCH_CHECK(p.requires_grad(), "FusedAdamW: a parameter does not require grad");
    exp_avg_.push_back(at::zeros_like(p));
    exp_avg_sq_.push_back(at::zeros_like(p));
    steps_.push_back(at::zeros({}, p.options().dtype(at::kFloat)));
  }
}

void FusedAdamW::zero_grad() {
  for (auto& p : params_) p.mutable_grad() = at::Tensor();
}

void FusedAdamW::step() {
  at::NoGradGuard no_grad;
  // One fused call per (device, dtype): the kernel takes lists of tensors of one kind.
  struct Group {
    std::vector<at::Tensor> params, grads, exp_avg, exp_avg_sq, steps;
  };
  std::map<std::tuple<int, int, int>, Group> groups;
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& p = params_[i];
    if (!p.grad().defined()) continue;
    auto& g = groups[{static_cast<int>(p.device().type()), p.device().index(), static_cast<int>(p.scalar_type())}];
    g.params.push_back(p);
    g.grads.push_back(p.grad());
    g.exp_avg.push_back(exp_avg_[i]);
    g.exp_avg_sq.push_back(exp_avg_sq_[i]);
    g.steps.push_back(steps_[i]);
  }
  for (auto& [key, g] : groups) {
    at::_foreach_add_(g.steps, 1);
    if (lr_tensor_.defined()) {
      at::_fused_adamw_(g.params, g.grads, g.exp_avg, g.exp_avg_sq, /*max_exp_avg_sqs=*/{}, g.steps, lr_tensor_,
                        options_.beta1, options_.beta2, options_.weight_decay, options_.eps, /*amsgrad=*/false,
                        /*maximize=*/false);
    } else {
      at::_fused_adamw_(g.params, g.grads, g.exp_avg, g.exp_avg_sq, /*max_exp_avg_sqs=*/{}, g.steps, options_.lr,
                        options_.beta1, options_.beta2, options_.weight_decay, options_.eps, /*amsgrad=*/false,
                        /*maximize=*/false);
    }
  }
}

}  // namespace symbiosis

namespace symbiosis {

std::vector<at::Tensor> FusedAdamW::state() const {
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < params_.size(); ++i) {
    out.push_back(exp_avg_[i]);
    out.push_back(exp_avg_sq_[i]);
    out.push_back(steps_[i]);
  }
  return out;
}

void FusedAdamW::load_state(const std::vector<at::Tensor>& saved) {
  const auto now = state();
  TORCH_CHECK(saved.size() == now.size(), "FusedAdamW: the saved state holds ", saved.size(), " tensors, expected ",
              now.size(), " (three per parameter)");
  for (size_t i = 0; i < now.size(); ++i) {
    TORCH_CHECK(saved[i].sizes() == now[i].sizes(), "FusedAdamW: saved state tensor ", i, " has shape ",
                saved[i].sizes(), ", expected ", now[i].sizes());
  }
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < now.size(); ++i) now[i].copy_(saved[i]);
}

}  // namespace symbiosis
