#include "virt_layer/virt_layer.h"

#include <torch/autograd.h>

#include "virt_layer/virt_layer_function.h"

namespace symbiosis {
namespace {

using Binding = VirtLayerBinding;

// [Decode halves]: this thread's BackendRedirect, if any.
thread_local const LayerBackend* redirected_from = nullptr;
thread_local LayerBackend* redirected_to = nullptr;

LayerBackend& backend_of(const Binding& binding) {
  return binding.backend.get() == redirected_from ? *redirected_to : *binding.backend;
}

at::Tensor flatten_for_wire(const at::Tensor& x, int64_t features, at::ScalarType dtype) {
  return x.reshape({-1, features}).to(dtype).contiguous();
}

at::Tensor unflatten(const at::Tensor& y, const at::Tensor& like, int64_t features) {
  auto shape = like.sizes().vec();
  shape.back() = features;
  return y.to(like.options().requires_grad(false)).reshape(shape);
}

class VirtLayerFunction : public torch::autograd::Function<VirtLayerFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            c10::intrusive_ptr<Binding> binding, bool with_bias) {
    ctx->saved_data["binding"] = c10::IValue::make_capsule(binding);
    ctx->saved_data["input_dtype"] = c10::IValue(static_cast<int64_t>(x.scalar_type()));
    return virt_layer_forward(x, *binding, with_bias);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto binding = c10::static_intrusive_pointer_cast<Binding>(ctx->saved_data["binding"].toCapsule());
    const auto& info = binding->info;
    const auto& g = grads[0];
    auto gin = backend_of(*binding).backward_input(info, flatten_for_wire(g, info.out_features, info.dtype));
    auto shape = g.sizes().vec();
    shape.back() = info.in_features;
    auto dtype = static_cast<at::ScalarType>(ctx->saved_data["input_dtype"].toInt());
    return {gin.to(g.device(), dtype).reshape(shape), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor virt_layer_forward(const at::Tensor& x, const VirtLayerBinding& binding, bool with_bias) {
  const auto& info = binding.info;
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == info.in_features, "base layer ", info.name, ": input has ",
              x.dim() >= 1 ? x.size(-1) : 0, " features, expected ", info.in_features);
  auto y = backend_of(binding).forward(info, flatten_for_wire(x, info.in_features, info.dtype), with_bias);
  return unflatten(y, x, info.out_features);
}

at::Tensor virt_layer_apply(const at::Tensor& x, const c10::intrusive_ptr<VirtLayerBinding>& binding, bool with_bias) {
  return VirtLayerFunction::apply(x, binding, with_bias);
}

VirtLayerImpl::VirtLayerImpl(LayerInfo info, std::shared_ptr<LayerBackend> backend)
    : info_(std::move(info)), backend_(std::move(backend)) {
  TORCH_CHECK(backend_, "VirtLayer ", info_.name, " needs a backend");
  binding_ = c10::make_intrusive<VirtLayerBinding>();
  binding_->info = info_;
  binding_->backend = backend_;
}

at::Tensor VirtLayerImpl::forward(const at::Tensor& x) { return virt_layer_apply(x, binding_, true); }

c10::intrusive_ptr<VirtLayerBinding> VirtLayerImpl::find(Lookup& lookup, const std::vector<uint32_t>& members,
                                                         const std::string& activation) {
  if (members != lookup.members || activation != lookup.activation) {
    lookup = {members, activation, {}};
    if (const auto* entry = backend_->group(members, activation)) {
      lookup.binding = c10::make_intrusive<VirtLayerBinding>();
      lookup.binding->info = *entry;
      lookup.binding->backend = backend_;
    }
  }
  return lookup.binding;
}

c10::intrusive_ptr<VirtLayerBinding> VirtLayerImpl::group_binding(const std::vector<uint32_t>& members) {
  return find(group_, members, "");
}

c10::intrusive_ptr<VirtLayerBinding> VirtLayerImpl::block_binding(const std::vector<uint32_t>& members,
                                                                  const std::string& activation) {
  return find(block_, members, activation);
}

BackendRedirect::BackendRedirect(const LayerBackend* from, LayerBackend* to) {
  if (to == nullptr) return;
  TORCH_CHECK(redirected_to == nullptr, "BackendRedirect: this thread already redirects its base-layer calls");
  TORCH_CHECK(from != nullptr, "BackendRedirect: no backend to redirect from");
  redirected_from = from;
  redirected_to = to_ = to;
}

BackendRedirect::~BackendRedirect() {
  if (to_ == nullptr) return;
  redirected_from = nullptr;
  redirected_to = nullptr;
}

at::Tensor VirtLayerImpl::forward_no_bias(const at::Tensor& x) { return virt_layer_apply(x, binding_, false); }

}  // namespace symbiosis
