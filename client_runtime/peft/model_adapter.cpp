#include "client_runtime/peft/model_adapter.h"

#include "client_runtime/models/attention.h"

namespace symbiosis {

ModelAdapterHost& model_adapter_host(torch::nn::Module& model) {
  auto* host = dynamic_cast<ModelAdapterHost*>(&model);
  TORCH_CHECK(host != nullptr, "model ", model.name(),
              " takes no model-level adapter (prompt tuning, P-tuning, prefix tuning): it is not a ModelAdapterHost");
  return *host;
}

namespace detail {

AdaptedInputs adapt_inputs(ModelAdapterImpl* adapter, const at::Tensor& embeddings, const at::Tensor& attention_mask,
                           const at::Tensor& position_ids, int64_t num_layers, int64_t sliding_window) {
  TORCH_CHECK(embeddings.dim() == 3, "embeddings have shape ", embeddings.sizes(),
              ", expected [batch, tokens, hidden]");
  const int64_t batch = embeddings.size(0), length = embeddings.size(1), hidden = embeddings.size(2);
  const auto device = embeddings.device();
  const auto dtype = embeddings.scalar_type();
  const auto long_options = at::TensorOptions().dtype(at::kLong).device(device);
  AdaptedInputs out;

  at::Tensor prompts = adapter ? adapter->prompt_embeddings() : at::Tensor();
  std::vector<PastKeyValue> past = adapter ? adapter->past_key_values() : std::vector<PastKeyValue>();
  if (prompts.defined()) {
    TORCH_CHECK(prompts.dim() == 2 && prompts.size(1) == hidden, "model adapter's prompt embeddings have shape ",
                prompts.sizes(), ", expected [virtual tokens, ", hidden, "]");
    out.prompt_length = prompts.size(0);
    out.embeddings =
        at::cat({prompts.to(device).to(dtype).unsqueeze(0).expand({batch, out.prompt_length, hidden}), embeddings}, 1);
  } else {
    out.embeddings = embeddings;
  }
  int64_t past_length = 0;
  if (!past.empty()) {
    TORCH_CHECK(static_cast<int64_t>(past.size()) == num_layers, "model adapter gives past keys and values for ",
                past.size(), " layers, but the model has ", num_layers);
    past_length = past[0].key.size(-2);
    for (auto& kv : past) {
      TORCH_CHECK(kv.key.sizes() == kv.value.sizes() && kv.key.size(-2) == past_length, "model adapter's past keys ",
                  kv.key.sizes(), " and values ", kv.value.sizes(), " disagree in shape");
      auto batched = [&](const at::Tensor& t) {
        auto u = t.to(device).to(dtype);
        return u.dim() == 3 ? u.unsqueeze(0).expand({batch, u.size(0), u.size(1), u.size(2)}) : u;
      };
      out.past.push_back({batched(kv.key), batched(kv.value)});
    }
  }

  // Positions of the real tokens, then of the prompts in front, then shifted past the cache.
  at::Tensor positions =
      position_ids.defined() ? position_ids.to(device).to(at::kLong) : at::arange(length, long_options);
  positions = positions.dim() == 1 ? positions.unsqueeze(0).expand({batch, positions.size(0)}) : positions;
  TORCH_CHECK(positions.sizes() == at::IntArrayRef({batch, length}), "position_ids has shape ", position_ids.sizes(),
              ", expected [", batch, ", ", length, "] or [", length, "]");
  if (out.prompt_length > 0) {
    positions = at::cat({at::arange(out.prompt_length, long_options).unsqueeze(0).expand({batch, out.prompt_length}),
                         positions + out.prompt_length},
                        1);
  }
  out.position_ids = positions + past_length;

  // Causal among the P+T positions; every query sees the whole cache; padding masked. Plain
  // causal attention needs no mask at all (attention() then uses the causal kernels).
  if (!attention_mask.defined() && past_length == 0 && sliding_window == 0) return out;
  const int64_t queries = out.prompt_length + length, keys = past_length + queries;
  auto q = at::arange(queries, long_options).view({queries, 1}) + past_length;
  auto k = at::arange(keys, long_options).view({1, keys});
  auto allowed = (k <= q).view({1, 1, queries, keys}).expand({batch, 1, queries, keys});
  // [Sliding window]: by index among the cache's, the virtual and the real tokens, as transformers
  // counts them.
  const auto in_window = (k > q - sliding_window).view({1, 1, queries, keys});
  if (attention_mask.defined()) {
    TORCH_CHECK(attention_mask.dim() == 2 && attention_mask.size(0) == batch && attention_mask.size(1) == length,
                "attention_mask has shape ", attention_mask.sizes(), ", expected [", batch, ", ", length, "]");
    auto full = at::cat({at::ones({batch, keys - length}, long_options), attention_mask.to(device).to(at::kLong)}, 1);
    allowed = allowed.logical_and(full.to(at::kBool).view({batch, 1, 1, keys}));
  }
  if (sliding_window > 0) out.sliding_mask = additive_mask(allowed.logical_and(in_window), dtype);
  if (attention_mask.defined() || past_length > 0) out.additive_mask = additive_mask(allowed, dtype);
  return out;
}

}  // namespace detail
}  // namespace symbiosis
