#include "client_runtime/peft/prompt.h"

#include <ATen/ATen.h>

#include "client_runtime/peft/files.h"

namespace symbiosis {
namespace {

ModelShape shape_of(torch::nn::Module& model) { return model_adapter_host(model).model_shape(); }

std::vector<at::Tensor> attach(torch::nn::Module& model, const std::shared_ptr<PromptLearningAdapterImpl>& adapter) {
  const auto where = peft::parameter_options(model);
  adapter->to(where.device(), where.dtype().toScalarType());
  model_adapter_host(model).set_model_adapter(adapter);
  return adapter->parameters();
}

}  // namespace

void PromptTuningConfig::validate() const {
  TORCH_CHECK(num_virtual_tokens > 0, "prompt tuning field 'num_virtual_tokens' must be positive, got ",
              num_virtual_tokens);
}

void PTuningConfig::validate() const {
  TORCH_CHECK(num_virtual_tokens > 0, "P-tuning field 'num_virtual_tokens' must be positive, got ", num_virtual_tokens);
  TORCH_CHECK(encoder_hidden_size >= 0, "P-tuning field 'encoder_hidden_size' must be positive, got ",
              encoder_hidden_size);
}

void PrefixTuningConfig::validate() const {
  TORCH_CHECK(num_virtual_tokens > 0, "prefix tuning field 'num_virtual_tokens' must be positive, got ",
              num_virtual_tokens);
  TORCH_CHECK(encoder_hidden_size >= 0, "prefix tuning field 'encoder_hidden_size' must be positive, got ",
              encoder_hidden_size);
  TORCH_CHECK(prefix_projection || encoder_hidden_size == 0,
              "prefix tuning field 'encoder_hidden_size' is set but 'prefix_projection' is false");
}

PromptTuningAdapterImpl::PromptTuningAdapterImpl(const ModelShape& shape, int64_t num_virtual_tokens,
                                                 const std::string& peft_type)
    : PromptLearningAdapterImpl(peft_type, shape, num_virtual_tokens) {
  embedding = register_parameter("embedding", at::randn({num_virtual_tokens, shape.hidden_size}));
}

PTuningAdapterImpl::PTuningAdapterImpl(const ModelShape& shape, const PTuningConfig& config)
    : PromptLearningAdapterImpl("P_TUNING", shape, config.num_virtual_tokens) {
  config.validate();
  const int64_t hidden = shape.hidden_size;
  encoder_hidden_size = config.encoder_hidden_size > 0 ? config.encoder_hidden_size : hidden;
  embedding = register_parameter("embedding", at::randn({config.num_virtual_tokens, hidden}));
  mlp_0 = register_module("mlp_0", torch::nn::Linear(hidden, encoder_hidden_size));
  mlp_2 = register_module("mlp_2", torch::nn::Linear(encoder_hidden_size, encoder_hidden_size));
  mlp_4 = register_module("mlp_4", torch::nn::Linear(encoder_hidden_size, hidden));
}

at::Tensor PTuningAdapterImpl::prompt_embeddings() {
  return mlp_4->forward(at::relu(mlp_2->forward(at::relu(mlp_0->forward(embedding)))));
}

PrefixTuningAdapterImpl::PrefixTuningAdapterImpl(const ModelShape& shape, const PrefixTuningConfig& config)
    : PromptLearningAdapterImpl("PREFIX_TUNING", shape, config.num_virtual_tokens) {
  config.validate();
  prefix_projection = config.prefix_projection;
  const int64_t dim = token_dim();
  const int64_t out = shape.num_layers * 2 * dim;
  if (!prefix_projection) {
    embedding = register_parameter("embedding", at::randn({config.num_virtual_tokens, out}));
    return;
  }
  encoder_hidden_size = config.encoder_hidden_size > 0 ? config.encoder_hidden_size : dim;
  embedding = register_parameter("embedding", at::randn({config.num_virtual_tokens, dim}));
  transform_0 = register_module("transform_0", torch::nn::Linear(dim, encoder_hidden_size));
  transform_2 = register_module("transform_2", torch::nn::Linear(encoder_hidden_size, out));
}

at::Tensor PrefixTuningAdapterImpl::encode() {
  if (!prefix_projection) return embedding;
  return transform_2->forward(at::tanh(transform_0->forward(embedding)));
}

std::vector<PastKeyValue> PrefixTuningAdapterImpl::past_key_values() {
  // PEFT: view [P, layers*2, kv_heads, head_dim], then layer l's key is entry 2l, its value 2l+1.
  const auto& s = shape();
  auto kv =
      encode().view({num_virtual_tokens(), s.num_layers * 2, s.num_key_value_heads, s.head_dim}).permute({1, 2, 0, 3});
  std::vector<PastKeyValue> past;
  for (int64_t l = 0; l < s.num_layers; ++l) past.push_back({kv[2 * l], kv[2 * l + 1]});
  return past;
}

std::vector<at::Tensor> add_prompt_tuning(torch::nn::Module& model, const PromptTuningConfig& config) {
  config.validate();
  return attach(model, std::make_shared<PromptTuningAdapterImpl>(shape_of(model), config.num_virtual_tokens));
}

std::vector<at::Tensor> add_p_tuning(torch::nn::Module& model, const PTuningConfig& config) {
  return attach(model, std::make_shared<PTuningAdapterImpl>(shape_of(model), config));
}

std::vector<at::Tensor> add_prefix_tuning(torch::nn::Module& model, const PrefixTuningConfig& config) {
  return attach(model, std::make_shared<PrefixTuningAdapterImpl>(shape_of(model), config));
}

std::shared_ptr<PromptLearningAdapterImpl> prompt_learning_adapter(torch::nn::Module& model) {
  auto* host = dynamic_cast<ModelAdapterHost*>(&model);
  return host ? std::dynamic_pointer_cast<PromptLearningAdapterImpl>(host->model_adapter()) : nullptr;
}

void save_prompt_learning(torch::nn::Module& model, const std::filesystem::path& dir) {
  auto adapter = prompt_learning_adapter(model);
  TORCH_CHECK(adapter, "the model has no prompt-learning adapter to save");
  const auto& s = adapter->shape();
  const bool prefix = adapter->peft_type() == "PREFIX_TUNING";
  nlohmann::json j = {{"peft_type", adapter->peft_type()},
                      {"task_type", "CAUSAL_LM"},
                      {"num_virtual_tokens", adapter->num_virtual_tokens()},
                      {"token_dim", adapter->token_dim()},
                      {"num_transformer_submodules", 1},
                      {"num_attention_heads", prefix ? s.num_key_value_heads : s.num_attention_heads},
                      {"num_layers", s.num_layers},
                      {"inference_mode", false},
                      {"base_model_name_or_path", nullptr},
                      {"modules_to_save", nullptr}};
  if (adapter->peft_type() == "PROMPT_TUNING") {
    j["prompt_tuning_init"] = "RANDOM";
    j["prompt_tuning_init_text"] = nullptr;
    j["tokenizer_name_or_path"] = nullptr;
    j["tokenizer_kwargs"] = nullptr;
  } else if (adapter->peft_type() == "P_TUNING") {
    j["encoder_reparameterization_type"] = "MLP";
    j["encoder_hidden_size"] = adapter->encoder_hidden_size > 0 ? adapter->encoder_hidden_size : s.hidden_size;
    j["encoder_num_layers"] = 2;
    j["encoder_dropout"] = 0.0;
  } else {
    j["prefix_projection"] = adapter->prefix_projection;
    j["encoder_hidden_size"] = adapter->encoder_hidden_size > 0 ? adapter->encoder_hidden_size : adapter->token_dim();
  }
  at::NoGradGuard no_grad;
  peft::write_adapter(dir, j, {{"prompt_embeddings", adapter->saved_embeddings()}});
}

std::vector<at::Tensor> load_prompt_learning(torch::nn::Module& model, const std::filesystem::path& dir) {
  const auto j = peft::read_config(dir);
  const std::string where = (dir / "adapter_config.json").string() + ": ";
  const std::string type = j.value("peft_type", "");
  TORCH_CHECK(type == "PROMPT_TUNING" || type == "P_TUNING" || type == "PREFIX_TUNING", where, "field 'peft_type' is '",
              type, "', expected PROMPT_TUNING, P_TUNING or PREFIX_TUNING");
  const auto shape = shape_of(model);
  const bool prefix = type == "PREFIX_TUNING";
  auto number = [&](const std::string& field) -> std::optional<int64_t> {
    if (!j.contains(field) || j[field].is_null()) return std::nullopt;
    TORCH_CHECK(j[field].is_number_integer(), where, "field '", field, "' should be an integer, got ", j[field].dump());
    return j[field].get<int64_t>();
  };
  auto must_equal = [&](const std::string& field, int64_t expected, const std::string& what) {
    auto v = number(field);
    TORCH_CHECK(!v || *v == expected, where, "field '", field, "' is ", *v, ", but the model's ", what, " is ",
                expected);
  };
  auto virtual_tokens = number("num_virtual_tokens");
  TORCH_CHECK(virtual_tokens && *virtual_tokens > 0, where, "field 'num_virtual_tokens' must be a positive integer");
  const int64_t token_dim = prefix ? shape.num_key_value_heads * shape.head_dim : shape.hidden_size;
  must_equal("num_transformer_submodules", 1, "number of transformer submodules (decoder only)");
  must_equal("num_layers", shape.num_layers, "number of layers");
  must_equal("token_dim", token_dim, prefix ? "key/value width (kv_heads * head_dim)" : "hidden size");
  if (prefix) must_equal("num_attention_heads", shape.num_key_value_heads, "number of key/value heads");
  if (type == "PROMPT_TUNING") {
    // The init only matters for a new adapter; a saved one brings its embeddings.
  }
  auto tensors = peft::read_tensors(dir);
  const auto file = dir / "adapter_model.safetensors";
  TORCH_CHECK(tensors.size() == 1 && tensors.count("prompt_embeddings"), file,
              " should hold exactly one tensor, 'prompt_embeddings'");
  const auto& saved = tensors.at("prompt_embeddings");
  std::shared_ptr<PromptLearningAdapterImpl> adapter;
  at::Tensor table;
  if (prefix) {
    PrefixTuningConfig config;
    config.num_virtual_tokens = *virtual_tokens;
    auto a = std::make_shared<PrefixTuningAdapterImpl>(shape, config);
    table = a->embedding;
    adapter = a;
  } else {
    auto a = std::make_shared<PromptTuningAdapterImpl>(shape, *virtual_tokens, type);
    table = a->embedding;
    adapter = a;
  }
  TORCH_CHECK(saved.sizes() == table.sizes(), file, ": tensor 'prompt_embeddings' has shape ", saved.sizes(),
              ", expected ", table.sizes(), " for ", type, " with num_virtual_tokens ", *virtual_tokens);
  {
    at::NoGradGuard no_grad;
    table.copy_(saved);
  }
  return attach(model, adapter);
}

}  // namespace symbiosis
