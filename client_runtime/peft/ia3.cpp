#include "client_runtime/peft/ia3.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "client_runtime/peft/files.h"
#include "client_runtime/peft/model_adapter.h"

namespace symbiosis {
namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool is_feedforward(const std::string& path, const IA3Config& config) {
  return std::any_of(config.feedforward_modules.begin(), config.feedforward_modules.end(),
                     [&](const std::string& ff) { return ends_with(path, ff); });
}

}  // namespace

void IA3Config::validate() const {
  for (const auto& ff : feedforward_modules) {
    TORCH_CHECK(std::find(target_modules.begin(), target_modules.end(), ff) != target_modules.end(),
                "IA3 field 'feedforward_modules' holds '", ff,
                "', which is not in 'target_modules' (PEFT requires a subset)");
  }
  TORCH_CHECK(!target_modules.empty() || feedforward_modules.empty(),
              "IA3 field 'feedforward_modules' is set but 'target_modules' is empty");
}

IA3Config IA3Config::resolved_for(torch::nn::Module& model) const {
  if (!target_modules.empty()) {
    validate();
    return *this;
  }
  IA3Config c = *this;
  auto* host = dynamic_cast<ModelAdapterHost*>(&model);
  const std::string type = host ? host->model_shape().model_type : "";
  // PEFT's defaults (TRANSFORMERS_MODELS_TO_IA3_TARGET_MODULES_MAPPING), by model_type.
  if (type == "llama" || type == "mistral") {
    c.target_modules = {"k_proj", "v_proj", "down_proj"};
    c.feedforward_modules = {"down_proj"};
  } else if (type == "qwen2" || type == "qwen3" || type == "gemma2") {
    c.target_modules = {"q_proj", "v_proj", "down_proj"};
    c.feedforward_modules = {"down_proj"};
  } else if (type == "gpt2" || type == "gpt_bigcode") {
    c.target_modules = {"c_attn", "mlp.c_proj"};
    c.feedforward_modules = {"mlp.c_proj"};
  } else if (type == "opt") {
    c.target_modules = {"q_proj", "k_proj", "fc2"};
    c.feedforward_modules = {"fc2"};
  } else if (type == "gpt_neox") {
    c.target_modules = {"query_key_value", "dense_4h_to_h"};
    c.feedforward_modules = {"dense_4h_to_h"};
  } else if (type == "phi") {
    c.target_modules = {"q_proj", "v_proj", "fc2"};
    c.feedforward_modules = {"fc2"};
  } else {  // none for phi3 in PEFT either
    TORCH_CHECK(false, "IA3 field 'target_modules' is empty and the model (", model.name(),
                ") has no PEFT default targets: name them");
  }
  c.validate();
  return c;
}

IA3AdapterImpl::IA3AdapterImpl(int64_t in_features, int64_t out_features, bool feedforward_, bool init_ones)
    : feedforward(feedforward_) {
  auto shape = feedforward ? std::vector<int64_t>{1, in_features} : std::vector<int64_t>{out_features, 1};
  ia3_l = register_parameter("ia3_l", init_ones ? at::ones(shape) : at::randn(shape));
}

at::Tensor IA3AdapterImpl::forward(const at::Tensor& x, const BaseFn& base) {
  auto scale = ia3_l.flatten();
  if (feedforward) return base((x.to(scale.scalar_type()) * scale).to(x.scalar_type()));
  auto y = base(x);
  return (y * scale).to(y.scalar_type());
}

std::vector<at::Tensor> add_ia3(torch::nn::Module& model, const IA3Config& requested) {
  const auto config = requested.resolved_for(model);
  const auto where = peft::parameter_options(model);
  std::vector<at::Tensor> params;
  for (const auto& item : model.named_modules("", false)) {
    auto* base = dynamic_cast<nn::BaseLayerImpl*>(item.value().get());
    if (base == nullptr || !peft::matches_module(item.key(), config.target_modules)) continue;
    auto adapter = std::make_shared<IA3AdapterImpl>(base->in_features(), base->out_features(),
                                                    is_feedforward(item.key(), config), config.init_ia3_weights);
    adapter->to(where.device(), where.dtype().toScalarType());
    base->set_adapter(adapter);
    params.push_back(adapter->ia3_l);
  }
  TORCH_CHECK(!params.empty(), peft::no_layer_matched(model, "IA3 field 'target_modules'", config.target_modules));
  return params;
}

std::vector<std::pair<std::string, at::Tensor>> ia3_state(torch::nn::Module& model) {
  std::vector<std::pair<std::string, at::Tensor>> state;
  for (const auto& [path, ia3] : peft::layer_adapters<IA3AdapterImpl>(model)) {
    state.emplace_back(peft::kKeyPrefix + path + ".ia3_l", ia3->ia3_l);
  }
  return state;
}

void save_ia3(torch::nn::Module& model, const IA3Config& requested, const std::filesystem::path& dir) {
  const auto config = requested.resolved_for(model);
  auto state = ia3_state(model);
  TORCH_CHECK(!state.empty(), "the model has no IA3 adapters to save");
  auto* host = dynamic_cast<ModelAdapterHost*>(&model);
  const bool conv1d = host && host->model_shape().model_type == "gpt2";
  nlohmann::json j = {{"peft_type", "IA3"},
                      {"task_type", "CAUSAL_LM"},
                      {"target_modules", config.target_modules},
                      {"feedforward_modules", config.feedforward_modules},
                      {"fan_in_fan_out", conv1d},
                      {"init_ia3_weights", config.init_ia3_weights},
                      {"modules_to_save", nullptr},
                      {"exclude_modules", nullptr},
                      {"inference_mode", false},
                      {"base_model_name_or_path", nullptr}};
  peft::write_adapter(dir, j, state);
}

IA3Config read_ia3_config(const std::filesystem::path& dir) {
  const auto j = peft::read_config(dir, "IA3");
  const std::string where = (dir / "adapter_config.json").string() + ": ";
  try {
    TORCH_CHECK(!(j.contains("target_modules") && j["target_modules"].is_string()), where,
                "IA3 field 'target_modules' is a regular expression; only a list of names is supported");
    TORCH_CHECK(!(j.contains("feedforward_modules") && j["feedforward_modules"].is_string()), where,
                "IA3 field 'feedforward_modules' is a regular expression; only a list of names is supported");
    peft::require_default(j, "modules_to_save", nullptr, "extra trainable modules are not supported");
    peft::require_default(j, "exclude_modules", nullptr, "excluded modules are not supported");
    peft::require_default(j, "layers_to_transform", nullptr, "per-layer selection is not supported");
    peft::require_default(j, "layers_pattern", nullptr, "per-layer selection is not supported");
    IA3Config config;
    config.target_modules = peft::string_list(j, "target_modules", {});
    config.feedforward_modules = peft::string_list(j, "feedforward_modules", {});
    config.init_ia3_weights = j.value("init_ia3_weights", true);
    config.validate();
    return config;
  } catch (const c10::Error& e) {
    if (std::string(e.what_without_backtrace()).rfind(where, 0) == 0) throw;
    TORCH_CHECK(false, where, e.what_without_backtrace());
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, where, "bad IA3 field: ", e.what());
  }
}

IA3Config load_ia3(torch::nn::Module& model, const std::filesystem::path& dir) {
  auto config = read_ia3_config(dir);
  if (ia3_state(model).empty()) peft::add_saved_adapter(dir, "IA3", [&] { add_ia3(model, config); });
  peft::load_state(dir, ia3_state(model), "IA3");
  return config;
}

}  // namespace symbiosis
