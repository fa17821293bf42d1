#include "client_runtime/peft/lora.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/nn/init.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <typeinfo>

#include "client_runtime/peft/dora.h"
#include "client_runtime/peft/files.h"
#include "client_runtime/peft/model_adapter.h"

#ifdef SYMBIOSIS_WITH_CUDA
#include "kernels/lora.h"
#endif

namespace symbiosis {
namespace {

// PEFT's get_pattern_key: re.match(rf"(.*\.)?({key})$", path).
template <typename Map>
const typename Map::mapped_type* pattern_value(const Map& patterns, const std::string& path, const char* field) {
  for (const auto& [key, value] : patterns) {
    if (peft::regex_matches(path, "(.*\\.)?(" + key + ")", field)) return &value;
  }
  return nullptr;
}

}  // namespace

bool lora_targets(const std::string& path, const LoraConfig& config) {
  const auto& targets = config.target_modules;
  const bool head = path == "lm_head" || path == "embed_out";
  if (!head && std::find(targets.begin(), targets.end(), "all-linear") != targets.end()) return true;
  return peft::matches_module(path, targets);
}

int64_t LoraConfig::rank_for(const std::string& path) const {
  const auto* v = pattern_value(rank_pattern, path, "rank_pattern");
  return v ? *v : r;
}

double LoraConfig::alpha_for(const std::string& path) const {
  const auto* v = pattern_value(alpha_pattern, path, "alpha_pattern");
  return v ? *v : alpha;
}

void LoraConfig::validate() const {
  TORCH_CHECK(r > 0, "LoRA field 'r' must be positive, got ", r);
  TORCH_CHECK(alpha > 0, "LoRA field 'lora_alpha' must be positive, got ", alpha);
  TORCH_CHECK(dropout >= 0 && dropout < 1, "LoRA field 'lora_dropout' must be in [0, 1), got ", dropout);
  TORCH_CHECK(!target_modules.empty(), "LoRA field 'target_modules' is empty");
  TORCH_CHECK(bias == "none", "LoRA field 'bias' is '", bias, "'; only 'none' is supported");
  for (const auto& [key, rank] : rank_pattern) {
    TORCH_CHECK(rank > 0, "LoRA field 'rank_pattern' gives '", key, "' rank ", rank, ", expected a positive rank");
  }
  for (const auto& [key, a] : alpha_pattern) {
    TORCH_CHECK(a > 0, "LoRA field 'alpha_pattern' gives '", key, "' alpha ", a, ", expected a positive alpha");
  }
}

double lora_scaling(double alpha, int64_t r, bool use_rslora) {
  return alpha / (use_rslora ? std::sqrt(static_cast<double>(r)) : static_cast<double>(r));
}

LoraAdapterImpl::LoraAdapterImpl(int64_t in_features, int64_t out_features, const LoraConfig& config)
    : scaling(lora_scaling(config.alpha, config.r, config.use_rslora)), dropout(config.dropout) {
  // PEFT: A ~ kaiming_uniform(a=sqrt(5)), B = 0.
  auto a = at::empty({config.r, in_features});
  torch::nn::init::kaiming_uniform_(a, std::sqrt(5.0));
  auto b = at::zeros({out_features, config.r});
  if (!config.init_b_zero) torch::nn::init::kaiming_uniform_(b, std::sqrt(5.0));
  lora_A = register_parameter("lora_A", a);
  lora_B = register_parameter("lora_B", b);
}

namespace {

// base + (x·Aᵀ·Bᵀ)·scaling, the operations in the order of the expression left to autograd.
// Adapters may keep another dtype than the model (fp32 over a bf16 model): the products are in
// theirs. lora_rows gives x as [tokens, in] in A's dtype; lora_sum takes h = x·Aᵀ.
at::Tensor lora_rows(const at::Tensor& x, const at::Tensor& a) {
  return x.reshape({-1, x.size(-1)}).to(a.scalar_type());
}

at::Tensor lora_sum(const at::Tensor& base, const at::Tensor& h, const at::Tensor& b, double scaling) {
  auto update = at::mm(h, b.t()).to(base.scalar_type()).view(base.sizes());
  return at::add(base, update, scaling);  // one kernel scales and adds
}

// LoRA's update as one autograd node. Left to autograd it is some ten nodes per adapted layer (two
// products with their transposes and reshapes, a scaled add): after the base-layer calls
// the largest share of a client's host time (docs/benchmarks-history.md, [Op profile]). The
// gradients are the ones autograd computes for that expression, product for product.
class LoraUpdate : public torch::autograd::Function<LoraUpdate> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& base, const at::Tensor& x,
                            const at::Tensor& a, const at::Tensor& b, double scaling) {
    auto x2 = lora_rows(x, a);
    auto h = at::mm(x2, a.t());
    ctx->save_for_backward({x2, h, a, b});
    ctx->saved_data["scaling"] = scaling;
    ctx->saved_data["x_shape"] = x.sizes();
    ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
    return lora_sum(base, h, b, scaling);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x2 = saved[0], &h = saved[1], &a = saved[2], &b = saved[3];
    const auto& g = grads[0];
    // The scaled add's gradient, cast back to the adapter's dtype, as [tokens, out].
    auto gu = (g * ctx->saved_data["scaling"].toDouble()).to(a.scalar_type()).reshape({-1, g.size(-1)});
    at::Tensor grad_x, grad_a, grad_b;
    if (ctx->needs_input_grad(3)) grad_b = h.t().mm(gu).t();
    if (ctx->needs_input_grad(1) || ctx->needs_input_grad(2)) {
      auto grad_h = gu.mm(b);
      if (ctx->needs_input_grad(2)) grad_a = x2.t().mm(grad_h).t();
      if (ctx->needs_input_grad(1)) {
        const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["x_dtype"].toInt());
        grad_x = grad_h.mm(a).to(dtype).view(ctx->saved_data["x_shape"].toIntVector());
      }
    }
    return {ctx->needs_input_grad(0) ? g : at::Tensor(), grad_x, grad_a, grad_b, at::Tensor()};
  }
};

#ifdef SYMBIOSIS_WITH_CUDA
// [Grouped LoRA] (kernels/lora.h): the LoRA updates of adapters whose layers read one input x and
// whose base outputs lie side by side in `base` ([..., C]), as one autograd node. Forward: one
// product h = x·[A_1; A_2; ...]ᵀ and one kernel adding each member's h_m·B_mᵀ·s_m to its columns.
// Backward: per member, grad h_m = s_m·g_m·B_m (written into grad_h's columns) and grad B_m =
// s_m·g_mᵀ·h_m (laid out as B, so autograd keeps it without a copy); one product for the A's
// gradients side by side (each member's is a row block of it) and one for grad x. The scalings
// ride in cuBLAS's alpha. A single adapter is a group of one. Per step, LoraUpdate costs each
// adapter some 11 kernels; this costs a group of three (q, k, v of a Llama layer) 11, and an
// adapter alone 6.
class LoraGroupUpdate : public torch::autograd::Function<LoraGroupUpdate> {
 public:
  // layout: each member's column, width, rank column and scaling (their b unset; bs gives them).
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& base, const at::Tensor& x,
                            at::TensorList as, at::TensorList bs, const std::vector<kernels::LoraMember>& layout) {
    const int64_t columns = base.size(-1), rows = base.numel() / columns;
    const auto x2 = x.reshape({rows, x.size(-1)});
    const auto a = as.size() == 1 ? as[0] : at::cat(as, 0);
    const auto h = at::mm(x2, a.t());
    auto members = layout;
    for (size_t i = 0; i < members.size(); ++i) members[i].b = bs[i];
    auto out = kernels::lora_expand(base.reshape({rows, columns}), h, members).view(base.sizes());
    std::vector<at::Tensor> saved = {x2, h, a};
    saved.insert(saved.end(), bs.begin(), bs.end());
    ctx->save_for_backward(saved);
    std::vector<int64_t> places;
    std::vector<double> scalings;
    for (const auto& m : layout) {
      places.insert(places.end(), {m.column, m.width, m.h_column});
      scalings.push_back(m.scaling);
    }
    ctx->saved_data["places"] = places;
    ctx->saved_data["scalings"] = scalings;
    ctx->saved_data["x_shape"] = x.sizes();
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x2 = saved[0], &h = saved[1], &a = saved[2];
    const auto places = ctx->saved_data["places"].toIntVector();
    const auto scalings = ctx->saved_data["scalings"].toDoubleVector();
    const size_t n = scalings.size();
    std::vector<kernels::LoraMember> members(n);
    for (size_t i = 0; i < n; ++i) {
      members[i] = {places[3 * i], places[3 * i + 1], saved[3 + i], places[3 * i + 2], scalings[i]};
    }
    const auto& g = grads[0];
    auto g2 = g.reshape({x2.size(0), g.size(-1)});
    if (g2.stride(1) != 1) g2 = g2.contiguous();
    torch::autograd::variable_list out(2 + 2 * n + 1);
    if (ctx->needs_input_grad(0)) out[0] = g;
    // grad_h side by side: member m's rank columns s_m·g_m·B_m, written in place by cuBLAS (its
    // output's leading dimension is grad_h's width); the addend is read with beta 0: never.
    const auto unused = at::empty({}, g2.options());
    auto grad_h = at::empty_like(h);
    for (const auto& m : members) {
      auto columns = grad_h.narrow(1, m.h_column, m.b.size(1));
      at::addmm_out(columns, unused, g2.narrow(1, m.column, m.width), m.b, /*beta=*/0, /*alpha=*/m.scaling);
    }
    if (ctx->needs_input_grad(1)) out[1] = at::mm(grad_h, a).view(ctx->saved_data["x_shape"].toIntVector());
    const auto any_a = [&] {
      for (size_t i = 0; i < n; ++i) {
        if (ctx->needs_input_grad(2 + i)) return true;
      }
      return false;
    }();
    const auto grad_a = any_a ? at::mm(grad_h.t(), x2) : at::Tensor();
    for (size_t i = 0; i < n; ++i) {
      const auto& m = members[i];
      const int64_t rank = m.b.size(1);
      if (ctx->needs_input_grad(2 + i)) out[2 + i] = grad_a.narrow(0, m.h_column, rank);
      if (ctx->needs_input_grad(2 + n + i)) {
        out[2 + n + i] = at::addmm(unused, g2.narrow(1, m.column, m.width).t(), h.narrow(1, m.h_column, rank),
                                   /*beta=*/0, /*alpha=*/m.scaling);
      }
    }
    return out;
  }
};
#endif

}  // namespace

at::Tensor LoraAdapterImpl::forward_group(const at::Tensor& x, const at::Tensor& stacked_base,
                                          const std::vector<LayerAdapterImpl*>& adapters,
                                          const std::vector<int64_t>& widths) {
#ifdef SYMBIOSIS_WITH_CUDA
  if (!x.is_cuda() || !stacked_base.is_cuda() || x.scalar_type() != stacked_base.scalar_type() ||
      adapters.size() != widths.size()) {
    return {};
  }
  std::vector<at::Tensor> as, bs;
  std::vector<kernels::LoraMember> layout;
  int64_t column = 0, h_column = 0;
  for (size_t i = 0; i < adapters.size(); column += widths[i], ++i) {
    if (adapters[i] == nullptr) continue;
    // LoRA exactly (not DoRA, which derives from it), without dropout, in the model's dtype.
    if (typeid(*adapters[i]) != typeid(LoraAdapterImpl)) return {};
    const auto& lora = static_cast<const LoraAdapterImpl&>(*adapters[i]);
    if ((lora.dropout > 0 && lora.is_training()) || lora.lora_A.scalar_type() != x.scalar_type() ||
        lora.lora_B.scalar_type() != x.scalar_type() || !lora.lora_B.is_contiguous() ||
        layout.size() == kernels::kLoraMaxMembers) {
      return {};
    }
    as.push_back(lora.lora_A);
    bs.push_back(lora.lora_B);
    layout.push_back({column, widths[i], at::Tensor(), h_column, lora.scaling});
    h_column += lora.lora_A.size(0);
  }
  if (layout.empty() || column != stacked_base.size(-1) || h_column > kernels::kLoraMaxRankTotal) return {};
  return LoraGroupUpdate::apply(stacked_base, x, at::TensorList(as), at::TensorList(bs), layout);
#else
  (void)x, (void)stacked_base, (void)adapters, (void)widths;
  return {};
#endif
}

at::Tensor LoraAdapterImpl::forward(const at::Tensor& x, const BaseFn& base) {
  auto y = base(x);
  if (auto grouped = forward_group(x, y, {this}, {y.size(-1)}); grouped.defined()) return grouped;
  auto h = dropout > 0 ? at::dropout(x, dropout, is_training()) : x;
  const bool differentiable = at::GradMode::is_enabled() && (y.requires_grad() || h.requires_grad() ||
                                                             lora_A.requires_grad() || lora_B.requires_grad());
  if (differentiable) return LoraUpdate::apply(y, h, lora_A, lora_B, scaling);
  return lora_sum(y, at::mm(lora_rows(h, lora_A), lora_A.t()), lora_B, scaling);
}

std::vector<at::Tensor> add_lora(torch::nn::Module& model, const LoraConfig& config) {
  config.validate();
  const auto where = peft::parameter_options(model);
  std::vector<at::Tensor> params;
  for (const auto& item : model.named_modules("", false)) {
    auto* base = dynamic_cast<nn::BaseLayerImpl*>(item.value().get());
    if (base == nullptr || !lora_targets(item.key(), config)) continue;
    LoraConfig layer_config = config;
    layer_config.r = config.rank_for(item.key());
    layer_config.alpha = config.alpha_for(item.key());
    std::shared_ptr<LoraAdapterImpl> adapter;
    std::shared_ptr<DoraAdapterImpl> dora;
    if (config.use_dora) {
      adapter = dora = std::make_shared<DoraAdapterImpl>(base->in_features(), base->out_features(), layer_config);
    } else {
      adapter = std::make_shared<LoraAdapterImpl>(base->in_features(), base->out_features(), layer_config);
    }
    adapter->to(where.device(), where.dtype().toScalarType());
    base->set_adapter(adapter);
    params.push_back(adapter->lora_A);
    params.push_back(adapter->lora_B);
    if (dora) params.push_back(dora->lora_magnitude_vector);
  }
  TORCH_CHECK(!params.empty(), peft::no_layer_matched(model, "LoRA target_modules", config.target_modules),
              " (or \"all-linear\": every one but lm_head)");
  return params;
}

std::vector<std::pair<std::string, at::Tensor>> lora_state(torch::nn::Module& model) {
  std::vector<std::pair<std::string, at::Tensor>> state;
  for (const auto& [path, lora] : peft::layer_adapters<LoraAdapterImpl>(model)) {  // DoRA's too
    const auto key = peft::kKeyPrefix + path;
    state.emplace_back(key + ".lora_A.weight", lora->lora_A);
    state.emplace_back(key + ".lora_B.weight", lora->lora_B);
    if (auto dora = std::dynamic_pointer_cast<DoraAdapterImpl>(lora)) {
      state.emplace_back(key + ".lora_magnitude_vector", dora->lora_magnitude_vector);
    }
  }
  return state;
}

std::vector<std::string> default_lora_targets(torch::nn::Module& model) {
  auto* host = dynamic_cast<ModelAdapterHost*>(&model);
  const std::string type = host ? host->model_shape().model_type : "";
  if (type == "llama" || type == "mistral" || type == "qwen2" || type == "qwen3" || type == "gemma2") {
    return {"q_proj", "v_proj"};
  }
  if (type == "gpt2" || type == "gpt_bigcode") return {"c_attn"};
  // PEFT's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING; it has none for phi3.
  if (type == "opt") return {"q_proj", "v_proj"};
  if (type == "gpt_neox") return {"query_key_value"};
  if (type == "phi") return {"q_proj", "v_proj", "fc1", "fc2"};
  TORCH_CHECK(false, "the model (", model.name(), ", model_type '", type,
              "') has no default LoRA targets in PEFT: name them (target_modules, --lora-targets)");
}

void require_every_lora_target_matches(torch::nn::Module& model, const std::vector<std::string>& targets) {
  for (const auto& target : targets) {
    if (target == "all-linear") continue;
    bool matched = false;
    for (const auto& item : model.named_modules("", false)) {
      if (dynamic_cast<nn::BaseLayerImpl*>(item.value().get()) != nullptr &&
          peft::matches_module(item.key(), {target})) {
        matched = true;
        break;
      }
    }
    TORCH_CHECK(matched, peft::no_layer_matched(model, "the LoRA target_modules entry", {target}));
  }
}

void save_lora(torch::nn::Module& model, const LoraConfig& config, const std::filesystem::path& dir) {
  auto state = lora_state(model);
  TORCH_CHECK(!state.empty(), "the model has no LoRA adapters to save");
  nlohmann::json j = {{"peft_type", "LORA"},
                      {"task_type", "CAUSAL_LM"},
                      {"r", config.r},
                      {"lora_alpha", config.alpha},
                      {"lora_dropout", config.dropout},
                      {"target_modules", config.target_modules},
                      {"bias", config.bias},
                      {"fan_in_fan_out", false},
                      {"use_rslora", config.use_rslora},
                      {"rank_pattern", config.rank_pattern},
                      {"alpha_pattern", config.alpha_pattern},
                      {"use_dora", config.use_dora},
                      {"inference_mode", false},
                      {"base_model_name_or_path", nullptr}};
  // PEFT reads "all-linear" as a string only (in a list it would be a module name).
  if (config.target_modules == std::vector<std::string>{"all-linear"}) j["target_modules"] = "all-linear";
  peft::write_adapter(dir, j, state);
}

namespace {

LoraConfig lora_fields(const nlohmann::json& j, const std::filesystem::path& dir) {
  const auto path = dir / "adapter_config.json";
  peft::check_config(j, dir, "LORA");
  LoraConfig config;
  config.r = peft::integer_field(j, "r", config.r, path.string() + ": ");
  config.alpha = j.value("lora_alpha", config.alpha);
  config.dropout = j.value("lora_dropout", config.dropout);
  if (j.contains("target_modules")) {
    const auto& t = j["target_modules"];
    TORCH_CHECK(!t.is_string() || t.get<std::string>() == "all-linear", path,
                ": field 'target_modules' is the regular expression ", t.dump(),
                "; only a list of names or \"all-linear\" is supported");
    config.target_modules =
        t.is_string() ? std::vector<std::string>{t.get<std::string>()} : t.get<std::vector<std::string>>();
  }
  config.use_dora = j.value("use_dora", false);
  config.use_rslora = j.value("use_rslora", false);
  if (j.contains("rank_pattern") && !j["rank_pattern"].is_null()) {
    config.rank_pattern = j["rank_pattern"].get<std::map<std::string, int64_t>>();
  }
  if (j.contains("alpha_pattern") && !j["alpha_pattern"].is_null()) {
    config.alpha_pattern = j["alpha_pattern"].get<std::map<std::string, double>>();
  }
  if (j.contains("bias") && j["bias"].is_string()) config.bias = j["bias"].get<std::string>();
  auto refuse_set = [&](const char* field, const char* why) {
    const bool set = j.contains(field) && !j[field].is_null() && !(j[field].is_array() && j[field].empty()) &&
                     !(j[field].is_object() && j[field].empty()) && j[field] != false;
    TORCH_CHECK(!set, path, ": field '", field, "' is ", j.contains(field) ? j[field].dump() : "", "; ", why);
  };
  refuse_set("modules_to_save", "extra trainable modules are not supported");
  refuse_set("layers_to_transform", "per-layer selection is not supported");
  refuse_set("exclude_modules", "excluded modules are not supported");
  refuse_set("trainable_token_indices", "trainable tokens are not supported");
  refuse_set("use_qalora", "QALoRA is not supported");
  refuse_set("lora_bias", "LoRA bias terms (lora_bias) are not supported");
  try {
    config.validate();
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, path, ": ", e.what_without_backtrace());
  }
  return config;
}

}  // namespace

LoraConfig read_lora_config(const std::filesystem::path& dir) { return parse_lora_config(peft::read_config(dir), dir); }

LoraConfig parse_lora_config(const nlohmann::json& config, const std::filesystem::path& dir) {
  try {
    return lora_fields(config, dir);
  } catch (const nlohmann::json::exception& e) {
    // A field of the wrong JSON type ("target_modules": false) names the file, as AdaLoRA's does.
    TORCH_CHECK(false, dir / "adapter_config.json", ": bad LoRA field: ", e.what());
  }
}

LoraConfig load_lora(torch::nn::Module& model, const std::filesystem::path& dir) {
  auto config = read_lora_config(dir);
  if (lora_state(model).empty()) peft::add_saved_adapter(dir, "LoRA", [&] { add_lora(model, config); });
  peft::load_state(dir, lora_state(model), "LoRA");
  for (const auto& [path, dora] : peft::layer_adapters<DoraAdapterImpl>(model)) dora->set_magnitude_loaded();
  return config;
}

}  // namespace symbiosis
