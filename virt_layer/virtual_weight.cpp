#include "virt_layer/virtual_weight.h"

#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/InferenceMode.h>
#include <torch/library.h>

#include <optional>

#include "virt_layer/virt_layer_function.h"

namespace symbiosis {
namespace {

// See [Virtual weights]. `transposed` is set on the view that weight.t() returns.
class VirtualWeightImpl : public c10::TensorImpl {
 public:
  VirtualWeightImpl(c10::intrusive_ptr<VirtLayerBinding> binding, c10::IntArrayRef sizes, caffe2::TypeMeta dtype,
                    bool transposed)
      : c10::TensorImpl(c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), dtype,
                        c10::Device(c10::DeviceType::PrivateUse1, 0)),
        binding(std::move(binding)),
        transposed(transposed) {
    set_sizes_contiguous(sizes);
    set_storage_access_should_throw();
  }

  c10::intrusive_ptr<c10::TensorImpl> shallow_copy_and_detach(const c10::VariableVersion& version,
                                                              bool allow_metadata_change) const override {
    return copy(version, allow_metadata_change);
  }
  c10::intrusive_ptr<c10::TensorImpl> shallow_copy_and_detach(c10::VariableVersion&& version,
                                                              bool allow_metadata_change) const override {
    return copy(std::move(version), allow_metadata_change);
  }
  // Module::to() ends in set_data(), which lands here.
  void shallow_copy_from(const c10::intrusive_ptr<c10::TensorImpl>& other) override {
    auto* v = dynamic_cast<VirtualWeightImpl*>(other.get());
    TORCH_CHECK(v, "a virtual weight can only take the place of another virtual weight");
    binding = v->binding;
    transposed = v->transposed;
    set_sizes_contiguous(v->sizes());
  }

  c10::intrusive_ptr<VirtLayerBinding> binding;
  bool transposed;

 private:
  template <typename Version>
  c10::intrusive_ptr<c10::TensorImpl> copy(Version&& version, bool allow_metadata_change) const {
    auto impl = c10::make_intrusive<VirtualWeightImpl>(binding, sizes(), dtype(), transposed);
    impl->set_version_counter(std::forward<Version>(version));
    impl->set_allow_tensor_metadata_change(allow_metadata_change);
    return impl;
  }
};

VirtualWeightImpl* as_virtual(const at::Tensor& t) {
  return t.defined() ? dynamic_cast<VirtualWeightImpl*>(t.unsafeGetTensorImpl()) : nullptr;
}

at::Tensor make_virtual(const c10::intrusive_ptr<VirtLayerBinding>& binding, c10::IntArrayRef sizes,
                        caffe2::TypeMeta dtype, bool transposed, const at::Tensor& like = {}) {
  // Derived from a normal tensor inside InferenceMode, the result must not be an inference tensor
  // (ADInplaceOrView would refuse to make it a view).
  std::optional<c10::InferenceMode> normal;
  if (like.defined() && !like.is_inference() && c10::InferenceMode::is_enabled()) normal.emplace(false);
  return at::Tensor(c10::make_intrusive<VirtualWeightImpl>(binding, sizes, dtype, transposed));
}

at::Tensor virtual_t(const at::Tensor& self) {
  auto* v = as_virtual(self);
  TORCH_CHECK(v, "t() on a PrivateUse1 tensor that is not a Symbiosis virtual weight");
  return make_virtual(v->binding, {self.size(1), self.size(0)}, self.dtype(), !v->transposed, self);
}

const c10::intrusive_ptr<VirtLayerBinding>& binding_of_matmul(const at::Tensor& x, const at::Tensor& w) {
  auto* v = as_virtual(w);
  TORCH_CHECK(v != nullptr && v->transposed && as_virtual(x) == nullptr, "a virtual weight of layer '",
              v ? v->binding->info.name : std::string("?"),
              "' supports only input.matmul(weight.t()), as torch::nn::Linear computes it");
  return v->binding;
}

at::Tensor virtual_matmul_autograd(const at::Tensor& x, const at::Tensor& w) {
  return virt_layer_apply(x, binding_of_matmul(x, w), /*with_bias=*/true);
}

at::Tensor virtual_matmul_inference(const at::Tensor& x, const at::Tensor& w) {
  return virt_layer_forward(x, *binding_of_matmul(x, w), /*with_bias=*/true);
}

at::Tensor virtual_same(const at::Tensor& self) {
  auto* v = as_virtual(self);
  TORCH_CHECK(v, "not a Symbiosis virtual weight");
  return make_virtual(v->binding, self.sizes(), self.dtype(), v->transposed, self);
}

at::Tensor virtual_to_copy(const at::Tensor& self, std::optional<at::ScalarType>, std::optional<at::Layout>,
                           std::optional<at::Device>, std::optional<bool>, bool, std::optional<at::MemoryFormat>) {
  return virtual_same(self);  // its weights live on the executor, in the executor's dtype
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, AutogradPrivateUse1, m) {
  m.impl("t", virtual_t);
  m.impl("matmul", virtual_matmul_autograd);
  m.impl("_to_copy", virtual_to_copy);
  m.impl("detach", virtual_same);
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("t", virtual_t);
  m.impl("matmul", virtual_matmul_inference);
  m.impl("_to_copy", virtual_to_copy);
  m.impl("detach", virtual_same);
  m.impl("alias", virtual_same);
}

bool is_virtual_weight(const at::Tensor& t) { return as_virtual(t) != nullptr; }

namespace {
// Module keeps its parameters in a protected registry; this reaches it without a subclass.
struct ParameterAccess : torch::nn::Module {
  using torch::nn::Module::parameters_;
};
}  // namespace

void virtualize_torch_linear(torch::nn::LinearImpl& linear, const LayerInfo& info,
                             const std::shared_ptr<LayerBackend>& backend) {
  const bool has_bias = linear.bias.defined();
  TORCH_CHECK(info.kind == LayerKind::kLinear && linear.weight.dim() == 2 &&
                  linear.weight.size(0) == info.out_features && linear.weight.size(1) == info.in_features &&
                  has_bias == info.bias,
              "cannot virtualize torch::nn::Linear(in=", linear.weight.size(1), ", out=", linear.weight.size(0),
              ", bias=", has_bias, ") as executor layer '", info.name, "', which is ", layer_kind_name(info.kind),
              "(in=", info.in_features, ", out=", info.out_features, ", bias=", info.bias, ")");
  auto binding = c10::make_intrusive<VirtLayerBinding>();
  binding->info = info;
  binding->backend = backend;
  auto& parameters = linear.*(&ParameterAccess::parameters_);
  auto weight = make_virtual(binding, linear.weight.sizes(), linear.weight.dtype(), false);
  linear.weight = weight;
  parameters["weight"] = weight;  // the old weight's memory is released here
  if (has_bias) {
    linear.bias = at::Tensor();  // the executor adds the bias
    parameters.erase("bias");
  }
}

}  // namespace symbiosis
