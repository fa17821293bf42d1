#include "virt_layer/layer_backend.h"

namespace symbiosis {

std::vector<at::Tensor> LayerBackend::forward_group(const std::vector<const LayerInfo*>& layers, const at::Tensor& x) {
  std::vector<at::Tensor> results;
  for (const auto* layer : layers) results.push_back(forward(*layer, x, /*with_bias=*/true));
  return results;
}

}  // namespace symbiosis
