#pragma once
// virtualize(): binds every base layer of a module tree that the executor serves, matched by the
// layer's path in the tree (= its checkpoint name), with no change to the model's code. Nested
// modules, ModuleList and Sequential are all walked. symbiosis::nn::Linear/Conv1D layers are bound
// to a VirtLayer (and can carry adapters); a plain torch::nn::Linear gets a virtual weight (see
// [Virtual weights] in virt_layer/virtual_weight.h). Either way the local weights are released.
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <string>

#include "client_runtime/client.h"

namespace symbiosis {

struct VirtualizeOptions {
  // Prepended to each module path before looking it up in the layer table ("" = as is).
  std::string name_prefix;
  // The layer table's name of a module path, when set (name_prefix is then unused): the executor
  // knows layers by their checkpoint names, which a checkpoint of the base model alone writes
  // without the model's top-level module ([Checkpoint layouts] in models/model_io.h).
  std::function<std::string(const std::string&)> layer_name;
  // Throw unless every layer the executor serves was found in the tree.
  bool require_all = false;
};

// Returns how many layers were bound. Throws naming the module when a served layer's kind or
// shape differs from the module's.
size_t virtualize(torch::nn::Module& root, const std::shared_ptr<LayerBackend>& backend,
                  const std::vector<LayerInfo>& layers, const VirtualizeOptions& options = {});
size_t virtualize(torch::nn::Module& root, const std::shared_ptr<Client>& client,
                  const VirtualizeOptions& options = {});

}  // namespace symbiosis
