#include "client_runtime/models/model_io.h"

#include <torch/csrc/autograd/grad_mode.h>

#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "client_runtime/nn.h"
#include "common/checkpoint.h"

namespace symbiosis {

namespace {

bool has_component(const std::string& name, const std::string& component) {
  std::stringstream ss(name);
  std::string part;
  while (std::getline(ss, part, '.')) {
    if (part == component) return true;
  }
  return false;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool starts_with(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }

// Checkpoint tensors that save_pretrained writes (or once wrote) but no model parameter holds.
bool ignorable_extra(const std::string& name) {
  return name == "lm_head.weight" ||                                               // tied to the input embeddings
         ends_with(name, ".attn.bias") || ends_with(name, ".attn.masked_bias") ||  // GPT-2 mask buffers
         ends_with(name, "rotary_emb.inv_freq");
}

struct BaseJob {
  std::string prefix;  // the checkpoint's name of the layer
  nn::BaseLayerImpl* layer;
};

struct ParamJob {
  std::string name;
  at::Tensor param;
};

}  // namespace

std::string CheckpointNames::of(const std::string& path) const {
  if (dropped_prefix.empty() || !starts_with(path, dropped_prefix + ".")) return path;
  return path.substr(dropped_prefix.size() + 1);
}

CheckpointNames checkpoint_names(torch::nn::Module& model, const Checkpoint& ckpt) {
  // Every tensor path the model reads from a checkpoint: its parameters, and its base layers'
  // weights (which an unmaterialized or virtual base layer does not hold as parameters).
  std::vector<std::string> paths;
  for (const auto& p : model.named_parameters(/*recurse=*/true)) paths.push_back(p.key());
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    if (dynamic_cast<nn::BaseLayerImpl*>(item.value().get())) paths.push_back(item.key() + ".weight");
  }
  CheckpointNames names;
  for (const auto& child : model.named_children()) {
    const std::string prefix = child.key() + ".";
    if (child.key() == "adapter") continue;
    bool named_with_prefix = false, named_without = false;
    for (const auto& name : ckpt.names()) named_with_prefix = named_with_prefix || starts_with(name, prefix);
    for (const auto& path : paths) {
      named_without = named_without || (starts_with(path, prefix) && ckpt.contains(path.substr(prefix.size())));
    }
    if (!named_with_prefix && named_without) {
      TORCH_CHECK(names.dropped_prefix.empty(), "checkpoint ", ckpt.dir(), " names the tensors of both '",
                  names.dropped_prefix, "' and '", child.key(), "' without their prefix; expected at most one");
      names.dropped_prefix = child.key();
    }
  }
  return names;
}

void load_weights(torch::nn::Module& model, const Checkpoint& ckpt) {
  const auto names = checkpoint_names(model, ckpt);  // [Checkpoint layouts]
  std::vector<BaseJob> base_jobs;
  std::vector<std::string> base_prefixes;
  std::set<std::string> used;
  std::vector<std::pair<std::string, std::vector<int64_t>>> needed;  // name, shape

  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    auto* base = dynamic_cast<nn::BaseLayerImpl*>(item.value().get());
    if (!base || has_component(item.key(), "adapter")) continue;
    base_prefixes.push_back(item.key() + ".");
    const std::string name = names.of(item.key());
    used.insert(name + ".weight");
    if (base->has_bias()) used.insert(name + ".bias");
    if (base->is_virtual()) continue;
    needed.emplace_back(name + ".weight", base->weight_shape());
    if (base->has_bias()) needed.emplace_back(name + ".bias", std::vector<int64_t>{base->out_features()});
    base_jobs.push_back({name, base});
  }

  std::vector<ParamJob> param_jobs;
  at::TensorOptions model_options = at::TensorOptions().dtype(at::kFloat);
  bool have_model_options = false;
  for (const auto& p : model.named_parameters(/*recurse=*/true)) {
    const std::string& name = p.key();
    if (has_component(name, "adapter")) continue;
    bool in_base = false;
    for (const auto& prefix : base_prefixes) in_base = in_base || starts_with(name, prefix);
    if (in_base) continue;
    if (!have_model_options) {
      model_options = p.value().options();
      have_model_options = true;
    }
    needed.emplace_back(names.of(name), p.value().sizes().vec());
    used.insert(names.of(name));
    param_jobs.push_back({names.of(name), p.value()});
  }

  // Check the whole table before changing anything.
  std::vector<std::string> missing;
  for (const auto& [name, shape] : needed) {
    if (!ckpt.contains(name)) missing.push_back(name);
  }
  auto list = [](const std::vector<std::string>& names) {
    std::string out;
    for (size_t i = 0; i < names.size() && i < 8; ++i) out += (i ? ", '" : "'") + names[i] + "'";
    if (names.size() > 8) out += " and " + std::to_string(names.size() - 8) + " more";
    return out;
  };
  TORCH_CHECK(missing.empty(), "checkpoint ", ckpt.dir(), " is missing tensor ", list(missing),
              " that the model needs");
  std::vector<std::string> extra;
  for (const auto& name : ckpt.names()) {
    if (!used.count(name) && !ignorable_extra(name)) extra.push_back(name);
  }
  if (ckpt.contains("lm_head.weight") && !used.count("lm_head.weight")) {
    // A tied checkpoint may carry the head as a copy of the embeddings; a different head would be
    // silently dropped, so it must equal the embeddings the model uses.
    bool equals_embeddings = false;
    for (const char* path : {"model.embed_tokens.weight", "transformer.wte.weight"}) {
      const std::string embed = names.of(path);
      if (used.count(embed) && ckpt.record(embed).shape == ckpt.record("lm_head.weight").shape) {
        equals_embeddings = equals_embeddings || at::equal(ckpt.tensor(embed), ckpt.tensor("lm_head.weight"));
      }
    }
    TORCH_CHECK(equals_embeddings, "checkpoint ", ckpt.dir(),
                " has an untied tensor 'lm_head.weight', but the model ties its head to the input embeddings");
  }
  TORCH_CHECK(extra.empty(), "checkpoint ", ckpt.dir(), " has tensor ", list(extra),
              " that the model does not use (does config.json match the weights?)");
  for (const auto& [name, shape] : needed) ckpt.tensor(name, shape);  // shape check, no copy

  {
    torch::NoGradGuard no_grad;
    for (auto& job : param_jobs) job.param.copy_(ckpt.tensor(job.name, job.param.sizes()));
  }
  for (auto& job : base_jobs) {
    auto* base = job.layer;
    const auto options = base->weight.defined() ? base->weight.options() : model_options;
    auto load = [&](const std::string& name, at::IntArrayRef shape) {
      return ckpt.tensor(name, shape).to(options, /*non_blocking=*/false, /*copy=*/true);
    };
    auto w = load(job.prefix + ".weight", base->weight_shape());
    at::Tensor b;
    if (base->has_bias()) b = load(job.prefix + ".bias", {base->out_features()});
    base->set_weights(w, b);
  }
}

namespace {

// Opens the checkpoint, builds a Model from its config.json (Config::from_checkpoint), loads it.
template <typename Model, typename Config>
Model load_model(const std::filesystem::path& dir, bool materialize_base, at::ScalarType dtype, at::Device device) {
  auto ckpt = Checkpoint::open(dir);
  Model model(Config::from_checkpoint(*ckpt), materialize_base);
  model->to(device, dtype);
  load_weights(*model, *ckpt);
  return model;
}

}  // namespace

LlamaForCausalLM load_llama(const std::filesystem::path& dir, bool materialize_base, at::ScalarType dtype,
                            at::Device device) {
  return load_model<LlamaForCausalLM, LlamaConfig>(dir, materialize_base, dtype, device);
}

GPT2LMHeadModel load_gpt2(const std::filesystem::path& dir, bool materialize_base, at::ScalarType dtype,
                          at::Device device) {
  return load_model<GPT2LMHeadModel, GPT2Config>(dir, materialize_base, dtype, device);
}

GPTNeoXForCausalLM load_gpt_neox(const std::filesystem::path& dir, bool materialize_base, at::ScalarType dtype,
                                 at::Device device) {
  return load_model<GPTNeoXForCausalLM, GPTNeoXConfig>(dir, materialize_base, dtype, device);
}

}  // namespace symbiosis
