#pragma once
// The executor's base layers: the frozen Linear (and GPT-2 Conv1D) weights of one checkpoint,
// chosen by a BaseLayerRule, on one device, in one dtype. Stateless: compute() saves nothing.
// Thread safety: immutable after load(); compute() may run from any thread.
#include <ATen/ATen.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/checkpoint.h"
#include "common/layer_info.h"

namespace symbiosis {

enum class LayerOp { kForward, kBackwardInput, kForwardNoBias };

// "q_proj,k_proj,v_proj;gate_proj,up_proj" (the --layer-groups flag) -> BaseLayerRule::groups
// ([Layer groups] below); "" for none. Throws naming a group of fewer than two layers.
std::vector<std::vector<std::string>> parse_layer_groups(const std::string& text);

// Which checkpoint tensors are base layers. By default: every 2-D "<module>.weight" of the
// decoder blocks (model.layers.N.* for the Llama family, Gemma 2 included, transformer.h.N.* for
// GPT-2 and GPTBigCode, or h.N.* where a GPT-2 checkpoint names its tensors without the prefix, as
// the Hub's do: [Checkpoint layouts] in client_runtime/models/model_io.h), never embeddings or
// norms; lm_head only when asked (a head tied to the embeddings then served from them: [Served
// tied head] in base_model.cpp). GPT-2's layers are Conv1D, every other architecture's Linear.
//
// [Layer groups]
// Layers that read one input (a Llama attention's q, k and v projections; its MLP's gate and up)
// are also served together, as one more entry of the layer table: a group, whose weight is its
// members' stacked ([sum of out, in]) and whose call is one GEMM where the members' calls are one
// each. Its forward gives the members' outputs side by side; its backward takes their output
// gradients side by side and returns the sum of their input gradients, in one product. A group
// of narrow layers runs far closer to the GPU's rate than its members one by one
// (bench/gemm_shapes.py: a [1024, 2048] x [2048, 512] product runs at 104 TFLOP/s on an H200),
// and a client's step makes fewer calls, each a hand-off between two processes. Memory stays the
// same: the members' weights become views of the group's. `groups` names the members by the last
// part of their names; every parent module that has all of a group's members, as Linear layers of
// one input width, dtype and bias, gets the group. Clients call a group instead of its members
// where their model computes the members from one input (forward_siblings in client_runtime/nn.h).
//
// [MLP blocks]
// With `mlp_blocks` (the default), each gated MLP (a parent module with gate_proj and up_proj, as a
// group, or Phi-3's gate_up_proj, and down_proj, none with a bias) is also served whole, as one more
// entry after the groups: a block, named by the parent ("model.layers.3.mlp"), whose forward is
// down(act(gate(x)) · up(x)), act the checkpoint's (config.json's hidden_activation, else
// hidden_act, when it is common/gated_activation.h's silu or gelu_pytorch_tanh; otherwise no
// block), computed as the tenant's model computes it. A decoding tenant whose MLP has no adapter and needs no gradient calls it where it
// made two calls (LlamaMLP in client_runtime/models/llama.cpp), and its decode step makes 49
// hand-offs between the two processes in place of 65 (a 16-layer model). Forward only: its
// backward would need the activation's input, which a stateless executor does not keep; and only
// on an executor of one part ([Parts]: a part holds a share of the intermediate features, and the
// down projection needs them all). On an H200, eight decoding tenants of Llama-3.2-1B's shape
// launched together decode 1.07× as fast with blocks as without, one 1.04× (docs/benchmarks.md). Its intermediate rows are scratch, taken from the compute's
// stream (in a capture, the captured work's own pool: [Captured allocations] in common/cuda.h).
//
// [MLP bridges]
// With `mlp_bridges` too (the default), for a pre-norm decoder of the Llama family (config.json's
// model_type llama, mistral, qwen2, qwen3 or phi3: not Gemma 2, whose norms sit around its MLP),
// each block but the last layer's is also served as a bridge into the next layer: one more entry
// after the blocks, whose members are the block and the next layer's q, k and v entry (their
// group, or Phi-3's qkv_proj), named "model.layers.3.mlp>model.layers.4.self_attn", and whose
// forward takes a layer's hidden state after its attention's residual, h ([rows, hidden]), and
// gives [h2 | n2 | qkv]: h2 = h + mlp(post_attention_layernorm(h)), the layer's output;
// n2 = the next layer's input_layernorm(h2); qkv, the next layer's q, k and v base outputs of n2
// side by side ([rows, 2 hidden + their widths]). The norms are at::rms_norm with the
// checkpoint's weights and rms_norm_eps, as the tenant's LlamaRMSNorm; the residual the tenant's
// add. A decoding tenant whose MLP has no adapter and needs no gradient calls it in place of the
// block and the next layer's q, k and v call, and applies the next layer's q, k and v adapters to
// what it gives (LlamaDecoderLayer in client_runtime/models/llama.cpp): a step of a 16-layer model
// makes 33 hand-offs in place of 49. The executor holds the two norms' weights of each bridge
// (2 hidden values a layer); forward only, as a block. Its activation field is the block's. On an
// H200 (Llama-3.2-1B's shape, bf16), over CUDA IPC, the calls it saves bought nothing measurable
// (eight tenants launched together 1.019x and 0.976x blocks alone, one 2.34 against 2.36 ms a
// token, one generator of 8 adapters 1.003x; docs/benchmarks.md, V84-V89), with 1.1 GB more GPU
// memory for their captured runs; over ZeroMQ TCP, where a hand-off costs most, a 16-layer tiny
// Llama's tenants on the CPU decoded 1.28-1.45x (one) and 1.01-1.27x (two) as fast. So the executor serves
// them, and a client calls them over TCP alone (Client::group in client_runtime/client.cpp).
struct BaseLayerRule {
  static constexpr const char* kDefaultPattern =
      R"(^(model\.layers|transformer\.h|h|model\.decoder\.layers|gpt_neox\.layers)\.[0-9]+\..+$)";
  std::string pattern = kDefaultPattern;  // ECMAScript regex over the module name
  bool lm_head = false;
  static constexpr const char* kDefaultGroups = "q_proj,k_proj,v_proj;gate_proj,up_proj";
  std::vector<std::vector<std::string>> groups = parse_layer_groups(kDefaultGroups);
  bool mlp_blocks = true;   // [MLP blocks]
  bool mlp_bridges = true;  // [MLP bridges]: with mlp_blocks only
};

// [Parts] (parts.h): the share of every base layer one part of a sharded executor holds, part
// `index` of `count`: the rows [size * index / count, size * (index + 1) / count) of each layer's
// output features. {0, 1}: the whole model.
struct Shard {
  int index = 0;
  int count = 1;
  // The share of `size` rows part `part` holds: {first, rows}.
  std::pair<int64_t, int64_t> rows(int64_t size, int part) const;
};

// Where a part's output columns of a layer go in the layer's whole output: `width` columns from
// `local` in the part's result to `global` in the whole. A layer has one block a part; a group one
// a member.
struct ColumnBlock {
  int64_t local = 0, global = 0, width = 0;
};

class BaseModel {
 public:
  // dtype: compute dtype; default the checkpoint's. shard: the share held ([Parts]); by default
  // all. Throws naming the checkpoint on bad input.
  static std::unique_ptr<BaseModel> load(const Checkpoint& checkpoint, const BaseLayerRule& rule, at::Device device,
                                         std::optional<at::ScalarType> dtype, const Shard& shard = {});

  const std::vector<LayerInfo>& layers() const { return layers_; }
  // [Layer groups]: ids from layers().size() on; [MLP blocks] after the groups.
  const std::vector<LayerInfo>& groups() const { return groups_; }
  // Any id the executor serves, a layer's or a group's: layer_count() of them.
  const LayerInfo& layer(uint32_t id) const {
    return id < layers_.size() ? layers_[id] : groups_.at(id - layers_.size());
  }
  size_t layer_count() const { return layers_.size() + groups_.size(); }
  // [MLP blocks]: whether `id` is a block's or a bridge's (entries that compute forward only).
  bool is_block(uint32_t id) const { return id < layer_count() && !layer(id).activation.empty(); }
  // [MLP bridges]: whether `id` is a bridge's.
  bool is_bridge(uint32_t id) const { return is_block(id) && is_block(layer(id).members[0]); }
  const std::string& model_hash() const { return model_hash_; }
  at::Device device() const { return device_; }
  size_t weight_bytes() const;  // held here: the shard's share
  const Shard& shard() const { return shard_; }
  // [Parts]: part `part`'s output columns of a layer (or group) within its whole output, and how
  // many there are (the width of compute()'s forward result there). Worked out once, at load.
  const std::vector<ColumnBlock>& columns(uint32_t layer_id, int part) const { return columns_.at(layer_id).at(part); }
  int64_t local_width(uint32_t layer_id, int part) const { return widths_.at(layer_id).at(part); }

  // x: [tokens, in] (FORWARD*) or [tokens, out] (BACKWARD_INPUT), on device(), in the layer dtype.
  // A shard computes with its share: forward gives its columns ([tokens, local_width]) and
  // backward-input takes them ([tokens, local_width]) and gives its part of the sum.
  at::Tensor compute(uint32_t layer_id, LayerOp op, const at::Tensor& x) const;
  // The same, written into `out` ([tokens, out features], contiguous, on device()): a client's
  // payload buffer receives its result without a copy.
  void compute_into(uint32_t layer_id, LayerOp op, const at::Tensor& x, at::Tensor& out) const;

 private:
  // Adds the groups `names` describe, stacking their members' weights.
  void add_groups(const std::vector<std::vector<std::string>>& names);
  // [MLP blocks] applying `activation` for every gated MLP served.
  void add_blocks(const std::string& activation);
  // [MLP bridges] for every block whose next layer's q, k and v entry is served.
  void add_bridges(const Checkpoint& checkpoint);
  // A bridge's forward ([MLP bridges]).
  void bridge_into(uint32_t bridge_id, const at::Tensor& h, at::Tensor& out) const;

  // Fills columns_ and widths_ for every id and part.
  void place_columns();
  std::pair<const at::Tensor&, const at::Tensor&> operands(uint32_t layer_id, LayerOp op) const;
  // out = x · matrix: on a GPU through cuBLAS directly where it applies ([Direct cuBLAS]).
  static void product_into(const at::Tensor& x, const at::Tensor& matrix, at::Tensor& out);
  struct Weights {
    at::Tensor weight;
    at::Tensor bias;
    // Views made once (a view per call costs a tensor allocation on every request): what x is
    // multiplied by forward ([in, out]) and backward ([out, in]).
    at::Tensor forward_matrix, backward_matrix;
  };
  at::Tensor no_bias_;  // undefined
  std::vector<LayerInfo> layers_, groups_;
  std::vector<Weights> weights_;  // by id: the layers first, then the groups
  // [MLP bridges]: by id, a bridge's post-attention norm's weight and the next layer's input norm's.
  struct BridgeNorms {
    at::Tensor post_attention, next_input;
  };
  std::map<uint32_t, BridgeNorms> bridge_norms_;
  double rms_norm_eps_ = 0;
  std::string model_hash_;
  at::Device device_{at::kCPU};
  Shard shard_;
  std::vector<std::vector<std::vector<ColumnBlock>>> columns_;  // by id, then part
  std::vector<std::vector<int64_t>> widths_;                    // by id, then part
};

}  // namespace symbiosis
