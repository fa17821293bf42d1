#include "virt_layer/virt_layer.h"

#include <torch/autograd.h>

#include "virt_layer/sibling_calls.h"
#include "virt_layer/virt_layer_function.h"

namespace symbiosis {

const char* layer_kind_name(LayerKind kind) {
  return kind == LayerKind::kLinear ? "Linear" : "Conv1D";
}

void check_layer_input(const at::Tensor& x, const LayerInfo& layer) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == layer.in_features, "base layer ", layer.name, ": input has ",
              x.dim() >= 1 ? x.size(-1) : 0, " features, expected ", layer.in_features);
}

at::Tensor flatten_for_wire(const at::Tensor& x, int64_t features, at::ScalarType dtype) {
  return x.reshape({-1, features}).to(dtype).contiguous();
}

at::Tensor unflatten(const at::Tensor& y, const at::Tensor& like, int64_t features) {
  auto shape = like.sizes().vec();
  shape.back() = features;
  return y.to(like.options().requires_grad(false)).reshape(shape);
}

namespace {

using Binding = VirtLayerBinding;

class VirtLayerFunction : public torch::autograd::Function<VirtLayerFunction> {
 public:
  // computed: the layer's result for x from the wire, where a group call already computed it.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            c10::intrusive_ptr<Binding> binding, bool with_bias,
                            const std::optional<at::Tensor>& computed) {
    ctx->saved_data["binding"] = c10::IValue::make_capsule(binding);
    ctx->saved_data["input_dtype"] = c10::IValue(static_cast<int64_t>(x.scalar_type()));
    if (computed) return unflatten(*computed, x, binding->info.out_features);
    return virt_layer_forward(x, *binding, with_bias);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto binding = c10::static_intrusive_pointer_cast<Binding>(ctx->saved_data["binding"].toCapsule());
    const auto& info = binding->info;
    const auto& g = grads[0];
    auto gin = binding->backend->backward_input(info, flatten_for_wire(g, info.out_features, info.dtype));
    auto shape = g.sizes().vec();
    shape.back() = info.in_features;
    auto dtype = static_cast<at::ScalarType>(ctx->saved_data["input_dtype"].toInt());
    return {gin.to(g.device(), dtype).reshape(shape), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor virt_layer_forward(const at::Tensor& x, const VirtLayerBinding& binding, bool with_bias) {
  const auto& info = binding.info;
  check_layer_input(x, info);
  auto y = binding.backend->forward(info, flatten_for_wire(x, info.in_features, info.dtype), with_bias);
  return unflatten(y, x, info.out_features);
}

at::Tensor virt_layer_apply_computed(const at::Tensor& x, const c10::intrusive_ptr<VirtLayerBinding>& binding,
                                    bool with_bias, const at::Tensor& computed) {
  return VirtLayerFunction::apply(x, binding, with_bias,
                                  computed.defined() ? std::optional<at::Tensor>(computed) : std::nullopt);
}

at::Tensor virt_layer_apply(const at::Tensor& x, const c10::intrusive_ptr<VirtLayerBinding>& binding,
                            bool with_bias) {
  // Inference tensors keep no version counter, so an unchanged input cannot be told apart.
  if (with_bias && binding->backend->max_group_size() > 1 && !x.is_inference()) return call_with_siblings(x, binding);
  return VirtLayerFunction::apply(x, binding, with_bias, std::optional<at::Tensor>());
}

VirtLayerImpl::VirtLayerImpl(LayerInfo info, std::shared_ptr<LayerBackend> backend)
    : info_(std::move(info)), backend_(std::move(backend)) {
  TORCH_CHECK(backend_, "VirtLayer ", info_.name, " needs a backend");
  binding_ = c10::make_intrusive<VirtLayerBinding>();
  binding_->info = info_;
  binding_->backend = backend_;
}

at::Tensor VirtLayerImpl::forward(const at::Tensor& x) { return virt_layer_apply(x, binding_, true); }

at::Tensor VirtLayerImpl::forward_no_bias(const at::Tensor& x) { return virt_layer_apply(x, binding_, false); }

}  // namespace symbiosis
