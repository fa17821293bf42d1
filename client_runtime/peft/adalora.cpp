#include "client_runtime/peft/adalora.h"

#include <ATen/ATen.h>

#include <cmath>

#include "client_runtime/peft/files.h"
#include "client_runtime/peft/model_adapter.h"

namespace symbiosis {
namespace {

std::vector<std::string> resolved_targets(torch::nn::Module& model, const AdaLoraConfig& config) {
  if (!config.target_modules.empty()) return config.target_modules;
  auto* host = dynamic_cast<ModelAdapterHost*>(&model);
  const std::string type = host ? host->model_shape().model_type : "";
  // PEFT's defaults (TRANSFORMERS_MODELS_TO_ADALORA_TARGET_MODULES_MAPPING, which has no mistral).
  if (type == "llama" || type == "qwen2" || type == "qwen3" || type == "gemma2") return {"q_proj", "v_proj"};
  if (type == "gpt2" || type == "gpt_bigcode") return {"c_attn"};
  if (type == "opt") return {"q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"};
  if (type == "gpt_neox") return {"query_key_value"};
  TORCH_CHECK(false, "AdaLoRA field 'target_modules' is empty and the model (", model.name(),
              ") has no PEFT default targets: name them");
}

std::vector<std::pair<std::string, std::shared_ptr<AdaLoraAdapterImpl>>> adalora_layers(torch::nn::Module& model) {
  return peft::layer_adapters<AdaLoraAdapterImpl>(model);
}

at::Tensor kept_index(const std::vector<bool>& keep) {
  std::vector<int64_t> index;
  for (size_t i = 0; i < keep.size(); ++i) {
    if (keep[i]) index.push_back(static_cast<int64_t>(i));
  }
  return at::tensor(index, at::kLong);
}

}  // namespace

void AdaLoraConfig::validate() const {
  TORCH_CHECK(init_r > 0, "AdaLoRA field 'init_r' must be positive, got ", init_r);
  TORCH_CHECK(target_r > 0, "AdaLoRA field 'target_r' must be positive, got ", target_r);
  TORCH_CHECK(alpha > 0, "AdaLoRA field 'lora_alpha' must be positive, got ", alpha);
  TORCH_CHECK(dropout >= 0 && dropout < 1, "AdaLoRA field 'lora_dropout' must be in [0, 1), got ", dropout);
  TORCH_CHECK(total_step > 0, "AdaLoRA field 'total_step' must be positive, got ", total_step);
  TORCH_CHECK(tinit >= 0 && tfinal >= 0 && tinit < total_step - tfinal, "AdaLoRA fields 'tinit' (", tinit,
              ") and 'tfinal' (", tfinal, ") leave no budgeting phase in 'total_step' (", total_step, ")");
  TORCH_CHECK(deltaT > 0, "AdaLoRA field 'deltaT' must be positive, got ", deltaT);
  TORCH_CHECK(beta1 > 0 && beta1 < 1, "AdaLoRA field 'beta1' must be in (0, 1), got ", beta1);
  TORCH_CHECK(beta2 > 0 && beta2 < 1, "AdaLoRA field 'beta2' must be in (0, 1), got ", beta2);
  TORCH_CHECK(orth_reg_weight >= 0, "AdaLoRA field 'orth_reg_weight' must be >= 0, got ", orth_reg_weight);
  for (const auto& [key, keep] : rank_pattern) {
    TORCH_CHECK(keep.size() <= static_cast<size_t>(init_r), "AdaLoRA field 'rank_pattern' gives '", key, "' ",
                keep.size(), " triplets, more than init_r = ", init_r);
  }
}

AdaLoraAdapterImpl::AdaLoraAdapterImpl(int64_t in_features, int64_t out_features, const AdaLoraConfig& config)
    : scaling(config.alpha), ranknum(static_cast<double>(config.init_r)), dropout(config.dropout) {
  const int64_t r = config.init_r;
  // PEFT draws E, A, B in this order before reset_lora_parameters re-initializes them.
  auto a = at::randn({r, in_features});
  auto e = at::randn({r, 1});
  auto b = at::randn({out_features, r});
  if (config.init_lora_weights) {
    e.zero_();
    a.normal_(0.0, 0.02);
    b.normal_(0.0, 0.02);
  }
  lora_A = register_parameter("lora_A", a);
  lora_E = register_parameter("lora_E", e);
  lora_B = register_parameter("lora_B", b);
}

at::Tensor AdaLoraAdapterImpl::forward(const at::Tensor& x, const BaseFn& base) {
  auto h = dropout > 0 ? at::dropout(x, dropout, is_training()) : x;
  // As PEFT: ranknum is a float32 parameter, so its + 1e-5 rounds in float.
  const float denominator = static_cast<float>(ranknum) + 1e-5f;
  auto update = at::matmul(at::matmul(h.to(lora_A.scalar_type()), (lora_A * lora_E).t()), lora_B.t());
  return base(x) + update * scaling / denominator;
}

void AdaLoraAdapterImpl::keep_triplets(const std::vector<bool>& keep) {
  TORCH_CHECK(static_cast<int64_t>(keep.size()) == rank(), "AdaLoRA rank_pattern has ", keep.size(),
              " entries for a layer of rank ", rank());
  auto index = kept_index(keep);
  at::NoGradGuard no_grad;
  lora_A.set_data(lora_A.index_select(0, index));
  lora_E.set_data(lora_E.index_select(0, index));
  lora_B.set_data(lora_B.index_select(1, index));
}

std::vector<at::Tensor> add_adalora(torch::nn::Module& model, const AdaLoraConfig& config) {
  config.validate();
  const auto targets = resolved_targets(model, config);
  const auto where = peft::parameter_options(model);
  std::vector<at::Tensor> params;
  for (const auto& item : model.named_modules("", false)) {
    auto* base = dynamic_cast<nn::BaseLayerImpl*>(item.value().get());
    if (base == nullptr || !peft::matches_module(item.key(), targets)) continue;
    auto adapter = std::make_shared<AdaLoraAdapterImpl>(base->in_features(), base->out_features(), config);
    adapter->to(where.device(), where.dtype().toScalarType());
    base->set_adapter(adapter);
    params.insert(params.end(), {adapter->lora_A, adapter->lora_E, adapter->lora_B});
  }
  TORCH_CHECK(!params.empty(), peft::no_layer_matched(model, "AdaLoRA field 'target_modules'", targets));
  return params;
}

at::Tensor adalora_orthogonal_regularization(torch::nn::Module& model, const AdaLoraConfig& config) {
  at::Tensor sum;
  int64_t count = 0;
  for (const auto& [path, adapter] : adalora_layers(model)) {
    for (const auto& covariance :
         {at::matmul(adapter->lora_A, adapter->lora_A.t()), at::matmul(adapter->lora_B.t(), adapter->lora_B)}) {
      auto term = at::frobenius_norm(covariance - at::eye(covariance.size(0), covariance.options()), {0, 1});
      sum = sum.defined() ? sum + term : term;
      ++count;
    }
  }
  if (count == 0) return at::zeros({});
  return sum / static_cast<double>(count) * config.orth_reg_weight;
}

AdaLoraAllocator::AdaLoraAllocator(torch::nn::Module& model, AdaLoraConfig config)
    : config_(std::move(config)), layers_(adalora_layers(model)) {
  config_.validate();
  TORCH_CHECK(!layers_.empty(), "AdaLoraAllocator: the model has no AdaLoRA adapters");
  for (const auto& [path, adapter] : layers_) initial_budget_ += adapter->rank();
  target_budget_ = config_.target_r * static_cast<int64_t>(layers_.size());
}

std::pair<int64_t, bool> AdaLoraAllocator::budget_schedule(int64_t step) const {
  const auto& c = config_;
  if (step <= c.tinit) return {initial_budget_, false};
  if (step > c.total_step - c.tfinal) return {target_budget_, true};
  const double remaining =
      1.0 - static_cast<double>(step - c.tinit) / static_cast<double>(c.total_step - c.tfinal - c.tinit);
  const auto budget =
      static_cast<int64_t>(static_cast<double>(initial_budget_ - target_budget_) * std::pow(remaining, 3) +
                           static_cast<double>(target_budget_));
  return {budget, step % c.deltaT == 0};
}

void AdaLoraAllocator::update_importance() {
  at::NoGradGuard no_grad;
  if (statistics_.empty()) statistics_.resize(3 * layers_.size());
  size_t i = 0;
  for (const auto& [path, adapter] : layers_) {
    for (const auto* p : {&adapter->lora_A, &adapter->lora_E, &adapter->lora_B}) {
      TORCH_CHECK(p->grad().defined(), "AdaLoRA update_and_allocate: layer '", path,
                  "' has no gradient; call it after backward() and before zero_grad()");
      auto& s = statistics_[i++];
      if (!s.exp_avg_ipt.defined()) {
        s.exp_avg_ipt = at::zeros_like(*p);
        s.exp_avg_unc = at::zeros_like(*p);
      }
      auto ipt = (*p * p->grad()).abs();
      s.exp_avg_ipt = config_.beta1 * s.exp_avg_ipt + (1 - config_.beta1) * ipt;
      s.exp_avg_unc = config_.beta2 * s.exp_avg_unc + (1 - config_.beta2) * (ipt - s.exp_avg_ipt).abs();
    }
  }
}

void AdaLoraAllocator::mask_to_budget(int64_t budget) {
  TORCH_CHECK(!statistics_.empty(), "AdaLoRA allocation at a step with no importance statistics yet");
  std::vector<at::Tensor> triplet_scores;
  for (size_t l = 0; l < layers_.size(); ++l) {
    auto score = [&](size_t k) { return statistics_[3 * l + k].exp_avg_ipt * statistics_[3 * l + k].exp_avg_unc; };
    auto a = score(0).mean(1);  // [r]
    auto e = score(1).view(-1);
    auto b = score(2).mean(0);
    triplet_scores.push_back(e + (a + b));
  }
  const int64_t k = initial_budget_ - budget;
  TORCH_CHECK(k > 0, "AdaLoRA budget ", budget, " leaves nothing to mask of ", initial_budget_);
  const double threshold = std::get<0>(at::kthvalue(at::cat(triplet_scores), k)).item<double>();
  at::NoGradGuard no_grad;
  for (size_t l = 0; l < layers_.size(); ++l) {
    auto masked = triplet_scores[l] <= threshold;
    layers_[l].second->lora_E.masked_fill_(masked.view({-1, 1}), 0.0);
    std::vector<bool> keep;
    auto masked_cpu = masked.to(at::kCPU);
    for (int64_t i = 0; i < masked_cpu.size(0); ++i) keep.push_back(!masked_cpu[i].item<bool>());
    config_.rank_pattern[layers_[l].first + ".lora_E"] = keep;
  }
}

void AdaLoraAllocator::mask_using_rank_pattern() {
  at::NoGradGuard no_grad;
  for (const auto& [path, adapter] : layers_) {
    auto it = config_.rank_pattern.find(path + ".lora_E");
    TORCH_CHECK(it != config_.rank_pattern.end(), "AdaLoRA rank_pattern has no entry for '", path, ".lora_E'");
    TORCH_CHECK(static_cast<int64_t>(it->second.size()) == adapter->rank(), "AdaLoRA rank_pattern for '", path,
                "' has ", it->second.size(), " entries, the layer has rank ", adapter->rank());
    auto keep = at::zeros({adapter->rank(), 1}, at::kBool);
    for (size_t i = 0; i < it->second.size(); ++i) keep[static_cast<int64_t>(i)][0] = static_cast<bool>(it->second[i]);
    adapter->lora_E.masked_fill_(keep.logical_not().to(adapter->lora_E.device()), 0.0);
  }
}

void AdaLoraAllocator::update_and_allocate(int64_t global_step) {
  const int64_t final_step = config_.total_step - config_.tfinal;
  if (global_step < final_step) {
    update_importance();
    const auto [budget, allocate] = budget_schedule(global_step);
    if (allocate) mask_to_budget(budget);
  } else if (global_step == final_step) {
    // The last allocation: fixed from here on, and the statistics are dropped (PEFT's reset_ipt).
    mask_to_budget(budget_schedule(global_step).first);
    statistics_.clear();
  } else {
    mask_using_rank_pattern();
  }
}

std::vector<std::pair<std::string, at::Tensor>> adalora_state(torch::nn::Module& model, const AdaLoraConfig& config) {
  std::vector<std::pair<std::string, at::Tensor>> state;
  for (const auto& [path, adapter] : adalora_layers(model)) {
    at::Tensor a = adapter->lora_A, e = adapter->lora_E, b = adapter->lora_B;
    auto it = config.rank_pattern.find(path + ".lora_E");
    if (it != config.rank_pattern.end() && static_cast<int64_t>(it->second.size()) == adapter->rank()) {
      auto index = kept_index(it->second);
      a = a.index_select(0, index);
      e = e.index_select(0, index);
      b = b.index_select(1, index);
    }
    const auto key = peft::kKeyPrefix + path;
    state.emplace_back(key + ".lora_A", a);
    state.emplace_back(key + ".lora_B", b);
    state.emplace_back(key + ".lora_E", e);
  }
  return state;
}

void save_adalora(torch::nn::Module& model, const AdaLoraConfig& config, const std::filesystem::path& dir) {
  auto state = adalora_state(model, config);
  TORCH_CHECK(!state.empty(), "the model has no AdaLoRA adapters to save");
  nlohmann::json j = {{"peft_type", "ADALORA"},
                      {"task_type", "CAUSAL_LM"},
                      {"init_r", config.init_r},
                      {"target_r", config.target_r},
                      {"r", 8},  // PEFT's LoraConfig default; AdaLoRA ignores it
                      {"lora_alpha", config.alpha},
                      {"lora_dropout", config.dropout},
                      {"target_modules", resolved_targets(model, config)},
                      {"init_lora_weights", config.init_lora_weights},
                      {"tinit", config.tinit},
                      {"tfinal", config.tfinal},
                      {"deltaT", config.deltaT},
                      {"beta1", config.beta1},
                      {"beta2", config.beta2},
                      {"orth_reg_weight", config.orth_reg_weight},
                      {"total_step", config.total_step},
                      {"rank_pattern", nullptr},
                      {"bias", "none"},
                      {"fan_in_fan_out", false},
                      {"use_dora", false},
                      {"modules_to_save", nullptr},
                      {"inference_mode", false},
                      {"base_model_name_or_path", nullptr}};
  if (!config.rank_pattern.empty()) j["rank_pattern"] = config.rank_pattern;
  peft::write_adapter(dir, j, state);
}

AdaLoraConfig read_adalora_config(const std::filesystem::path& dir) {
  const auto j = peft::read_config(dir, "ADALORA");
  const std::string where = (dir / "adapter_config.json").string() + ": ";
  try {
    TORCH_CHECK(!(j.contains("target_modules") && j["target_modules"].is_string()), where,
                "AdaLoRA field 'target_modules' is a regular expression; only a list of names is supported");
    peft::require_default(j, "use_dora", false, "AdaLoRA has no DoRA");
    peft::require_default(j, "bias", "none", "only 'none' is supported");
    peft::require_default(j, "modules_to_save", nullptr, "extra trainable modules are not supported");
    peft::require_default(j, "exclude_modules", nullptr, "excluded modules are not supported");
    peft::require_default(j, "layers_to_transform", nullptr, "per-layer selection is not supported");
    peft::require_default(j, "alpha_pattern", nullptr, "per-layer alpha is not supported for AdaLoRA");
    peft::require_default(j, "lora_bias", false, "LoRA bias terms are not supported");
    AdaLoraConfig c;
    c.init_r = peft::integer_field(j, "init_r", c.init_r, where);
    c.target_r = peft::integer_field(j, "target_r", c.target_r, where);
    c.alpha = j.value("lora_alpha", c.alpha);
    c.dropout = j.value("lora_dropout", c.dropout);
    c.target_modules = peft::string_list(j, "target_modules", {});
    if (j.contains("init_lora_weights") && j["init_lora_weights"].is_boolean()) {
      c.init_lora_weights = j["init_lora_weights"].get<bool>();
    }
    auto number = [&](const char* field, auto fallback) {
      return j.contains(field) && !j[field].is_null() ? j[field].get<decltype(fallback)>() : fallback;
    };
    c.tinit = peft::integer_field(j, "tinit", c.tinit, where);
    c.tfinal = peft::integer_field(j, "tfinal", c.tfinal, where);
    c.deltaT = peft::integer_field(j, "deltaT", c.deltaT, where);
    c.total_step = peft::integer_field(j, "total_step", c.total_step, where);
    c.beta1 = number("beta1", c.beta1);
    c.beta2 = number("beta2", c.beta2);
    c.orth_reg_weight = number("orth_reg_weight", c.orth_reg_weight);
    if (j.contains("rank_pattern") && !j["rank_pattern"].is_null()) {
      c.rank_pattern = j["rank_pattern"].get<std::map<std::string, std::vector<bool>>>();
    }
    c.validate();
    return c;
  } catch (const c10::Error& e) {
    if (std::string(e.what_without_backtrace()).rfind(where, 0) == 0) throw;
    TORCH_CHECK(false, where, e.what_without_backtrace());
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, where, "bad AdaLoRA field: ", e.what());
  }
}

AdaLoraConfig load_adalora(torch::nn::Module& model, const std::filesystem::path& dir) {
  auto config = read_adalora_config(dir);
  if (adalora_layers(model).empty()) {
    peft::add_saved_adapter(dir, "AdaLoRA", [&] { add_adalora(model, config); });
    // PEFT's resize_modules_by_rank_pattern: the layers shrink to their kept triplets.
    for (const auto& [path, adapter] : adalora_layers(model)) {
      auto it = config.rank_pattern.find(path + ".lora_E");
      if (it == config.rank_pattern.end()) continue;
      TORCH_CHECK(static_cast<int64_t>(it->second.size()) == adapter->rank(), dir / "adapter_config.json",
                  ": field 'rank_pattern' gives '", it->first, "' ", it->second.size(),
                  " entries; its layer has init_r = ", adapter->rank());
      adapter->keep_triplets(it->second);
    }
  }
  // The adapters as they are now, unsliced by the config's rank_pattern.
  peft::load_state(dir, adalora_state(model, AdaLoraConfig{}), "AdaLoRA");
  return config;
}

}  // namespace symbiosis
