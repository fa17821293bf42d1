#include "client_runtime/inference/heterogeneous.h"

#include <torch/csrc/autograd/grad_mode.h>

#include <map>

namespace symbiosis {

AdapterMirror::AdapterMirror(torch::nn::Module& source, torch::nn::Module& mirror) {
  std::map<std::string, at::Tensor> mirrored;
  for (const auto& item : mirror.named_parameters()) {
    if (item.value().requires_grad()) mirrored.emplace(item.key(), item.value());
  }
  for (const auto& item : source.named_parameters()) {
    if (!item.value().requires_grad()) continue;
    const auto found = mirrored.find(item.key());
    TORCH_CHECK(found != mirrored.end(), "the decode-side model has no trainable parameter ", item.key(),
                ": attach the same adapter to both models");
    TORCH_CHECK(found->second.sizes() == item.value().sizes(), "trainable parameter ", item.key(), " is ",
                item.value().sizes(), " in the prefill model but ", found->second.sizes(), " in the decode-side model");
    pairs_.push_back({item.key(), item.value(), found->second, 0});
    mirrored.erase(found);
  }
  TORCH_CHECK(mirrored.empty(), "the decode-side model has trainable parameter ",
              mirrored.empty() ? "" : mirrored.begin()->first,
              " that the prefill model lacks: attach the same adapter to both models");
  at::NoGradGuard no_grad;
  for (auto& pair : pairs_) {
    pair.mirror.copy_(pair.source);
    pair.copied_version = pair.source._version();
  }
}

int64_t AdapterMirror::refresh() {
  at::NoGradGuard no_grad;
  int64_t copied = 0;
  for (auto& pair : pairs_) {
    const auto version = pair.source._version();
    if (version == pair.copied_version) continue;
    pair.mirror.copy_(pair.source);
    pair.copied_version = version;
    ++copied;
  }
  return copied;
}

}  // namespace symbiosis
