#include "client_runtime/virtualize.h"

#include <torch/nn/modules/linear.h>

#include <set>
#include <unordered_map>

#include "client_runtime/nn.h"
#include "virt_layer/virtual_weight.h"

namespace symbiosis {

size_t virtualize(torch::nn::Module& root, const std::shared_ptr<LayerBackend>& backend,
                  const std::vector<LayerInfo>& layers, const VirtualizeOptions& options) {
  std::unordered_map<std::string, const LayerInfo*> served;
  for (const auto& layer : layers) served[layer.name] = &layer;
  std::set<std::string> bound;
  for (const auto& item : root.named_modules("", /*include_self=*/false)) {
    const std::string name = options.layer_name ? options.layer_name(item.key()) : options.name_prefix + item.key();
    auto it = served.find(name);
    if (it == served.end()) continue;
    try {
      if (auto* base = dynamic_cast<nn::BaseLayerImpl*>(item.value().get())) {
        if (!base->is_virtual()) base->bind(VirtLayer(*it->second, backend));
      } else if (auto* linear = dynamic_cast<torch::nn::LinearImpl*>(item.value().get())) {
        // See [Virtual weights].
        if (!is_virtual_weight(linear->weight)) virtualize_torch_linear(*linear, *it->second, backend);
      } else {
        continue;  // a container or block that happens to share a name
      }
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, "cannot virtualize module '", name, "': ", e.what_without_backtrace());
    }
    bound.insert(name);
  }
  if (options.require_all) {
    for (const auto& layer : layers) {
      TORCH_CHECK(bound.count(layer.name), "the executor serves layer '", layer.name,
                  "' but the model has no base layer of that name");
    }
  }
  return bound.size();
}

size_t virtualize(torch::nn::Module& root, const std::shared_ptr<Client>& client, const VirtualizeOptions& options) {
  TORCH_CHECK(client, "virtualize needs a connected client");
  return virtualize(root, std::static_pointer_cast<LayerBackend>(client), client->layers(), options);
}

}  // namespace symbiosis
