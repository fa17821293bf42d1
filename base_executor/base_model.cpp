#include "base_executor/base_model.h"

#include <c10/util/Exception.h>

#include <map>
#include <regex>
#include <set>
#include <sstream>

#include "common/gated_activation.h"

#ifdef SYMBIOSIS_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>

#include "kernels/direct_gemm.h"
#endif

namespace symbiosis {

std::vector<std::vector<std::string>> parse_layer_groups(const std::string& text) {
  std::vector<std::vector<std::string>> groups;
  std::stringstream all(text);
  for (std::string group; std::getline(all, group, ';');) {
    if (group.empty()) continue;
    std::vector<std::string> names;
    std::stringstream members(group);
    for (std::string name; std::getline(members, name, ',');) {
      if (!name.empty()) names.push_back(name);
    }
    TORCH_CHECK(names.size() >= 2, "layer group '", group, "' names ", names.size(),
                " layer(s); a group stacks at least two (e.g. q_proj,k_proj,v_proj)");
    groups.push_back(std::move(names));
  }
  return groups;
}

std::pair<int64_t, int64_t> Shard::rows(int64_t size, int part) const {
  const int64_t first = size * part / count;
  return {first, size * (part + 1) / count - first};
}

std::unique_ptr<BaseModel> BaseModel::load(const Checkpoint& checkpoint, const BaseLayerRule& rule, at::Device device,
                                           std::optional<at::ScalarType> dtype, const Shard& shard) {
  std::regex pattern;
  try {
    pattern = std::regex(rule.pattern);
  } catch (const std::regex_error& e) {
    TORCH_CHECK(false, "bad base-layer pattern '", rule.pattern, "': ", e.what());
  }
  // [Any architecture] The executor serves any model_type: its base layers are the 2-D weights
  // under the rule's names, read as Linear ([out, in]) except GPT-2's Conv1D ([in, out]). The client
  // runtime's C++ models cover common/model_types.h's types; a Python tenant virtualizes any
  // transformers model (docs/python.md), and refuses a layer whose kind is not its module's.
  const auto model_type = checkpoint.config_string("model_type").value_or("");
  const bool conv1d = model_type == "gpt2";  // GPTBigCode, GPT-2's kin, has Linear layers
  auto model = std::unique_ptr<BaseModel>(new BaseModel());
  model->device_ = device;
  model->shard_ = shard;
  model->model_hash_ = checkpoint.model_hash();
  // One base layer, `module`, of the checkpoint's 2-D tensor `name` (its bias beside it, if any).
  auto add_layer = [&](const std::string& module, const std::string& name, LayerKind kind) {
    const auto& rec = checkpoint.record(name);
    LayerInfo info;
    info.id = static_cast<uint32_t>(model->layers_.size());
    info.name = module;
    info.kind = kind;
    info.in_features = info.kind == LayerKind::kLinear ? rec.shape[1] : rec.shape[0];
    info.out_features = info.kind == LayerKind::kLinear ? rec.shape[0] : rec.shape[1];
    info.dtype = dtype.value_or(rec.dtype);
    Weights w;
    // A memory-mapped tensor already in the right place and dtype is used as is (no copy). A
    // shard keeps its rows of the output features alone, in memory of its own ([Parts]).
    const auto [first, rows] = shard.rows(info.out_features, shard.index);
    auto held = [&](at::Tensor t, int64_t dim) {
      if (shard.count == 1) return t.to(device, info.dtype);
      return t.narrow(dim, first, rows).to(device, info.dtype).clone(at::MemoryFormat::Contiguous);
    };
    w.weight = held(checkpoint.tensor(name), info.kind == LayerKind::kLinear ? 0 : 1);
    const std::string bias_name = module + ".bias";
    if (checkpoint.contains(bias_name)) {
      info.bias = true;
      w.bias = held(checkpoint.tensor(bias_name, {info.out_features}), 0);
    }
    // Linear stores [out, in] (y = x·Wᵀ + b); Conv1D stores [in, out] (y = x·W + b).
    w.forward_matrix = info.kind == LayerKind::kLinear ? w.weight.t() : w.weight;
    w.backward_matrix = w.forward_matrix.t();
    model->layers_.push_back(info);
    model->weights_.push_back(std::move(w));
  };
  const std::string suffix = ".weight";
  for (const auto& name : checkpoint.names()) {
    if (name.size() <= suffix.size() || name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) continue;
    const std::string module = name.substr(0, name.size() - suffix.size());
    const bool is_lm_head = module == "lm_head";
    if (!(is_lm_head ? rule.lm_head : std::regex_match(module, pattern))) continue;
    if (checkpoint.record(name).shape.size() != 2) continue;  // norms and other vectors are not linear layers
    add_layer(module, name, conv1d && !is_lm_head ? LayerKind::kConv1D : LayerKind::kLinear);
  }
  // [Served tied head]: a checkpoint without lm_head.weight ties its head to its input embeddings
  // (Llama 3.2, Qwen2, Gemma 2, GPT-2, OPT). Each tenant would read the whole vocabulary's embeddings
  // once a decode step for its few rows; served, the head is one more base layer, "lm_head", of
  // those same weights, and tenants decoding together read them once for all.
  if (rule.lm_head && !checkpoint.contains("lm_head.weight")) {
    for (const char* embeddings : {"model.embed_tokens.weight", "embed_tokens.weight", "transformer.wte.weight",
                                   "wte.weight", "model.decoder.embed_tokens.weight", "decoder.embed_tokens.weight"}) {
      if (checkpoint.contains(embeddings)) {
        add_layer("lm_head", embeddings, LayerKind::kLinear);
        break;
      }
    }
  }
  TORCH_CHECK(!model->layers_.empty(), "checkpoint ", checkpoint.dir(), " (model_type '", model_type,
              "') has no base layers matching '", rule.pattern, "'", rule.lm_head ? " or lm_head" : "",
              ": name its base layers with --layer-pattern");
  model->add_groups(rule.groups);
  // [MLP blocks]: not on a part of a sharded executor, which holds a share of each MLP's
  // intermediate features where a block's down projection needs them all.
  if (rule.mlp_blocks && shard.count == 1) {
    model->add_blocks(checkpoint.config_string("hidden_activation")
                          .value_or(checkpoint.config_string("hidden_act").value_or("silu")));
    if (rule.mlp_bridges) model->add_bridges(checkpoint);
  }
  model->place_columns();
#ifdef SYMBIOSIS_WITH_CUDA
  // The members' weights, copied into their groups', are cached by the allocator: give them back.
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::emptyCache();
#endif
  return model;
}

void BaseModel::add_groups(const std::vector<std::vector<std::string>>& names) {
  std::map<std::string, uint32_t> by_name;
  std::set<std::string> parents;
  for (const auto& layer : layers_) {
    by_name[layer.name] = layer.id;
    const auto dot = layer.name.rfind('.');
    parents.insert(dot == std::string::npos ? "" : layer.name.substr(0, dot));  // "": the top level
  }
  std::vector<bool> grouped(layers_.size(), false);
  for (const auto& parent : parents) {
    for (const auto& group : names) {
      std::vector<uint32_t> members;
      for (const auto& name : group) {
        const auto it = by_name.find(parent.empty() ? name : parent + "." + name);
        if (it != by_name.end()) members.push_back(it->second);
      }
      if (members.size() != group.size()) continue;
      const auto& first = layers_[members[0]];
      bool stackable = true;
      for (const uint32_t id : members) {
        const auto& layer = layers_[id];
        stackable = stackable && !grouped[id] && layer.kind == LayerKind::kLinear &&
                    layer.in_features == first.in_features && layer.dtype == first.dtype && layer.bias == first.bias;
      }
      if (!stackable) continue;
      // The members' weights, stacked, become the group's; theirs become views of it.
      Weights stacked;
      std::vector<at::Tensor> weights, biases;
      for (const uint32_t id : members) {
        weights.push_back(weights_[id].weight);
        if (first.bias) biases.push_back(weights_[id].bias);
      }
      stacked.weight = at::cat(weights, 0);
      if (first.bias) stacked.bias = at::cat(biases, 0);
      LayerInfo info = first;
      info.id = static_cast<uint32_t>(layer_count());
      info.name = parent.empty() ? "{" : parent + ".{";
      info.out_features = 0;
      int64_t row = 0;  // in the stacked share
      for (size_t i = 0; i < members.size(); ++i) {
        auto& w = weights_[members[i]];
        const int64_t rows = w.weight.size(0);
        w.weight = stacked.weight.narrow(0, row, rows);
        if (first.bias) w.bias = stacked.bias.narrow(0, row, rows);
        w.forward_matrix = w.weight.t();
        w.backward_matrix = w.weight;
        row += rows;
        info.out_features += layers_[members[i]].out_features;
        info.name += (i ? "," : "") + group[i];
        grouped[members[i]] = true;
      }
      info.name += "}";
      info.members = members;
      stacked.forward_matrix = stacked.weight.t();
      stacked.backward_matrix = stacked.weight;
      groups_.push_back(std::move(info));
      weights_.push_back(std::move(stacked));
    }
  }
}

void BaseModel::add_blocks(const std::string& activation) {
  if (!is_gated_activation(activation)) return;  // one a block does not compute: the layers serve
  std::map<std::string, uint32_t> by_name;
  for (uint32_t id = 0; id < layer_count(); ++id) by_name[layer(id).name] = id;
  for (const auto& down : std::vector<LayerInfo>(layers_)) {  // a copy: groups_ grows below
    const auto dot = down.name.rfind('.');
    if (dot == std::string::npos || down.name.substr(dot + 1) != "down_proj") continue;
    const auto parent = down.name.substr(0, dot);
    auto gate_up = by_name.find(parent + ".{gate_proj,up_proj}");
    if (gate_up == by_name.end()) gate_up = by_name.find(parent + ".gate_up_proj");  // [Phi-3]
    if (gate_up == by_name.end()) continue;
    const LayerInfo first = layer(gate_up->second);
    if (first.bias || down.bias || first.kind != LayerKind::kLinear || down.kind != LayerKind::kLinear ||
        first.dtype != down.dtype || first.out_features != 2 * down.in_features) {
      continue;
    }
    LayerInfo block = first;
    block.id = static_cast<uint32_t>(layer_count());
    block.name = parent;
    block.out_features = down.out_features;
    block.members = {first.id, down.id};
    block.activation = activation;
    groups_.push_back(std::move(block));
    weights_.emplace_back();  // its members' weights are what it computes with
  }
}

void BaseModel::add_bridges(const Checkpoint& checkpoint) {
  // Pre-norm decoders: a layer's output is its MLP's residual, the next layer's input its input_layernorm's.
  static const std::set<std::string> pre_norm = {"llama", "mistral", "qwen2", "qwen3", "phi3"};
  const auto eps = checkpoint.config_number("rms_norm_eps");
  if (!pre_norm.count(checkpoint.config_string("model_type").value_or("")) || !eps) return;
  rms_norm_eps_ = *eps;
  std::map<std::string, uint32_t> by_name;
  for (uint32_t id = 0; id < layer_count(); ++id) by_name[layer(id).name] = id;
  for (const auto& block : std::vector<LayerInfo>(groups_)) {  // a copy: groups_ grows below
    if (block.activation.empty()) continue;
    // "model.layers.3.mlp": the layer "model.layers.3", the next "model.layers.4".
    const auto mlp = block.name.rfind('.');
    const auto layer_name = block.name.substr(0, mlp);
    const auto index = layer_name.rfind('.');
    if (mlp == std::string::npos || index == std::string::npos) continue;
    const auto digits = layer_name.substr(index + 1);
    if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos) continue;
    const auto next = layer_name.substr(0, index + 1) + std::to_string(std::stoll(digits) + 1);
    auto qkv = by_name.find(next + ".self_attn.{q_proj,k_proj,v_proj}");
    if (qkv == by_name.end()) qkv = by_name.find(next + ".self_attn.qkv_proj");  // [Phi-3]
    const auto post_attention = layer_name + ".post_attention_layernorm.weight";
    const auto next_input = next + ".input_layernorm.weight";
    if (qkv == by_name.end() || !checkpoint.contains(post_attention) || !checkpoint.contains(next_input)) continue;
    const LayerInfo attention = layer(qkv->second);
    if (attention.kind != LayerKind::kLinear || attention.in_features != block.out_features ||
        attention.dtype != block.dtype) {
      continue;
    }
    LayerInfo bridge = block;
    bridge.id = static_cast<uint32_t>(layer_count());
    bridge.name = block.name + ">" + next + ".self_attn";
    bridge.out_features = 2 * block.out_features + attention.out_features;
    bridge.members = {block.id, attention.id};
    const auto norm = [&](const std::string& name) {
      return checkpoint.tensor(name, {block.out_features}).to(device_, block.dtype);
    };
    bridge_norms_[bridge.id] = {norm(post_attention), norm(next_input)};
    groups_.push_back(std::move(bridge));
    weights_.emplace_back();  // its members' weights and its norms are what it computes with
  }
}

size_t BaseModel::weight_bytes() const {
  // A group's weights are its members': counted once, as the members'.
  size_t total = 0;
  for (size_t id = 0; id < layers_.size(); ++id) {
    const auto& w = weights_[id];
    total += w.weight.nbytes() + (w.bias.defined() ? w.bias.nbytes() : 0);
  }
  return total;
}

void BaseModel::place_columns() {
  columns_.assign(layer_count(), {});
  widths_.assign(layer_count(), {});
  for (uint32_t id = 0; id < layer_count(); ++id) {
    const auto& info = layer(id);
    for (int part = 0; part < shard_.count; ++part) {
      std::vector<ColumnBlock> blocks;
      int64_t local = 0, global = 0;
      // A layer's or a block's columns are its own; a group's, its members' side by side.
      const bool whole = info.members.empty() || !info.activation.empty();
      for (const uint32_t member : whole ? std::vector<uint32_t>{id} : info.members) {
        const int64_t out = layer(member).out_features;
        const auto [first, rows] = shard_.rows(out, part);
        blocks.push_back({local, global + first, rows});
        local += rows;
        global += out;
      }
      columns_[id].push_back(std::move(blocks));
      widths_[id].push_back(local);
    }
  }
}

// The matrix x is multiplied by, and the bias to add (undefined when none or not wanted).
std::pair<const at::Tensor&, const at::Tensor&> BaseModel::operands(uint32_t layer_id, LayerOp op) const {
  TORCH_CHECK(layer_id < weights_.size(), "unknown layer id ", layer_id);
  const auto& w = weights_[layer_id];
  switch (op) {
    case LayerOp::kForward: return {w.forward_matrix, w.bias};
    case LayerOp::kForwardNoBias: return {w.forward_matrix, no_bias_};
    case LayerOp::kBackwardInput: return {w.backward_matrix, no_bias_};
  }
  TORCH_CHECK(false, "unknown op");
}

at::Tensor BaseModel::compute(uint32_t layer_id, LayerOp op, const at::Tensor& x) const {
  if (is_block(layer_id)) {
    auto out = at::empty({x.size(0), layer(layer_id).out_features}, x.options());
    compute_into(layer_id, op, x, out);
    return out;
  }
  const auto [matrix, bias] = operands(layer_id, op);
  if (bias.defined()) return at::addmm(bias, x, matrix);
  auto out = at::empty({x.size(0), matrix.size(1)}, x.options());
  product_into(x, matrix, out);
  return out;
}

void BaseModel::compute_into(uint32_t layer_id, LayerOp op, const at::Tensor& x, at::Tensor& out) const {
  if (is_block(layer_id)) {
    const auto& block = layer(layer_id);
    TORCH_CHECK(op == LayerOp::kForward, "layer ", layer_id, " (", block.name,
                ") is an MLP block, which computes forward only ([MLP blocks] in base_executor/base_model.h)");
    if (is_bridge(layer_id)) return bridge_into(layer_id, x, out);
    // The tenant's own MLP, in its order: the gate-and-up product, the activation of its halves, the
    // down projection (common/gated_activation.h).
    const auto gate_up = compute(block.members[0], LayerOp::kForward, x);
    const int64_t n = gate_up.size(1) / 2;
    compute_into(block.members[1], LayerOp::kForward,
                 gated_activation(block.activation, gate_up.narrow(1, 0, n), gate_up.narrow(1, n, n)), out);
    return;
  }
  const auto [matrix, bias] = operands(layer_id, op);
  if (bias.defined()) {
    at::addmm_out(out, bias, x, matrix);
  } else {
    product_into(x, matrix, out);
  }
}

void BaseModel::bridge_into(uint32_t bridge_id, const at::Tensor& h, at::Tensor& out) const {
  // The tenant's decoder layer from its attention's residual on, then the next layer's first call,
  // each part computed as the tenant computes it, on rows of their own (contiguous, as the tenant's).
  const auto& bridge = layer(bridge_id);
  const auto& norms = bridge_norms_.at(bridge_id);
  const int64_t hidden = h.size(1);
  const auto h2 = at::add(
      h, compute(bridge.members[0], LayerOp::kForward, at::rms_norm(h, {hidden}, norms.post_attention, rms_norm_eps_)));
  const auto n2 = at::rms_norm(h2, {hidden}, norms.next_input, rms_norm_eps_);
  at::cat_out(out, {h2, n2, compute(bridge.members[1], LayerOp::kForward, n2)}, 1);
}

void BaseModel::product_into(const at::Tensor& x, const at::Tensor& matrix, at::Tensor& out) {
#ifdef SYMBIOSIS_WITH_CUDA
  if (cuda::gemm_into(x, matrix, out)) return;  // [Direct cuBLAS]
#endif
  at::mm_out(out, x, matrix);
}

}  // namespace symbiosis
