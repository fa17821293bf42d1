#include "virt_layer/sibling_calls.h"

#include <ATen/core/grad_mode.h>

#include <mutex>

#include "virt_layer/virt_layer_function.h"

namespace symbiosis {
namespace {

// Guards every binding's [Sibling calls] state and the last call. Never destroyed: bindings may
// go during static destruction.
std::mutex& sibling_mutex() {
  static auto* mutex = new std::mutex();
  return *mutex;
}

// The latest call that may still gain siblings: its layer and its input. Its binding's destructor
// forgets the layer, so the pointer never dangles.
struct LastCall {
  VirtLayerBinding* layer = nullptr;
  TensorIdentity input;
};

LastCall& last_call() {  // guarded by sibling_mutex()
  static auto* last = new LastCall();
  return *last;
}

bool can_lead(const VirtLayerBinding& b) { return !b.is_sibling && !b.never_group; }

bool can_join(const VirtLayerBinding& first, const VirtLayerBinding& b) {
  return can_lead(first) && can_lead(b) && b.siblings.empty() && b.backend == first.backend &&
         b.info.dtype == first.info.dtype && b.info.in_features == first.info.in_features &&
         first.siblings.size() + 1 < first.backend->max_group_size();
}

// After `binding` was called alone with x: it joins the previous call's group if that call had
// this very input.
void learn(const c10::intrusive_ptr<VirtLayerBinding>& binding, const at::Tensor& x) {
  auto& last = last_call();
  if (last.layer != nullptr && last.layer != binding.get() && last.input.matches(x) && can_join(*last.layer, *binding)) {
    last.layer->siblings.push_back(binding);
    binding->is_sibling = true;
    return;  // the first layer stays the last call: a third sibling may follow
  }
  last.layer = can_lead(*binding) ? binding.get() : nullptr;
  last.input = TensorIdentity::of(x);
}

// A sibling's result was never called for: the model does not call these layers together.
void unlearn(VirtLayerBinding& first) {
  for (auto& sibling : first.siblings) {
    sibling->is_sibling = false;
    sibling->never_group = true;
    sibling->waiting_result.reset();
    sibling->waiting_input.reset();
  }
  first.siblings.clear();
  first.never_group = true;
}

// The group's results for x, computed in one hand-off, first layer first (wire form).
std::vector<at::Tensor> compute_group(const at::Tensor& x, const VirtLayerBinding& first,
                                      const std::vector<c10::intrusive_ptr<VirtLayerBinding>>& siblings) {
  check_layer_input(x, first.info);
  std::vector<const LayerInfo*> layers = {&first.info};
  for (const auto& sibling : siblings) layers.push_back(&sibling->info);
  at::NoGradGuard no_grad;  // each layer's own node is made when it is called
  return first.backend->forward_group(layers, flatten_for_wire(x, first.info.in_features, first.info.dtype));
}

}  // namespace

TensorIdentity TensorIdentity::of(const at::Tensor& x) {
  return {c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(x.getIntrusivePtr()), x._version(),
          at::GradMode::is_enabled()};
}

bool TensorIdentity::matches(const at::Tensor& x) const {
  // While the weak reference lives, no other tensor can have this address.
  return tensor._unsafe_get_target() == x.unsafeGetTensorImpl() && version == x._version() &&
         grad_mode == at::GradMode::is_enabled();
}

VirtLayerBinding::~VirtLayerBinding() {
  std::lock_guard<std::mutex> lock(sibling_mutex());
  if (last_call().layer == this) last_call().layer = nullptr;
}

at::Tensor call_with_siblings(const at::Tensor& x, const c10::intrusive_ptr<VirtLayerBinding>& binding) {
  std::unique_lock<std::mutex> lock(sibling_mutex());
  at::Tensor computed;
  if (binding->waiting_result.defined() && binding->waiting_input->matches(x)) {
    computed = std::move(binding->waiting_result);
    binding->waiting_result.reset();
    binding->waiting_input.reset();
    last_call().layer = nullptr;
    lock.unlock();
    return virt_layer_apply_computed(x, binding, /*with_bias=*/true, computed);
  }
  if (!binding->siblings.empty()) {
    bool unclaimed = false;
    for (const auto& sibling : binding->siblings) unclaimed = unclaimed || sibling->waiting_result.defined();
    if (unclaimed) {
      unlearn(*binding);
    } else {
      const auto siblings = binding->siblings;
      const auto input = TensorIdentity::of(x);
      last_call().layer = nullptr;
      lock.unlock();
      auto results = compute_group(x, *binding, siblings);
      lock.lock();
      for (size_t i = 0; i < siblings.size(); ++i) {
        siblings[i]->waiting_result = results[i + 1];
        siblings[i]->waiting_input = input;
      }
      lock.unlock();
      return virt_layer_apply_computed(x, binding, /*with_bias=*/true, results[0]);
    }
  }
  lock.unlock();
  auto result = virt_layer_apply_computed(x, binding, /*with_bias=*/true, at::Tensor());
  lock.lock();
  learn(binding, x);
  return result;
}

}  // namespace symbiosis
