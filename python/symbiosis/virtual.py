"""Virtual layers: a Python model's base layers computed by the executor.

[Python virtual layers]
virtualize() replaces every torch.nn.Linear and transformers Conv1D whose module path names a layer
the executor serves by a VirtualLinear / VirtualConv1D: a subclass of the module it replaces (so
PEFT, transformers and user code that ask isinstance(m, nn.Linear) or isinstance(m, Conv1D) treat
it as before) that holds no base weights. Its forward is one autograd function: forward sends the
activation [tokens, in] to the executor (Client.forward), backward sends the output gradient and
returns grad_in = grad_out·W (Client.backward_input); nothing is saved between the two (the
executor is stateless), and the base weights are frozen, so there is no weight gradient. The bias,
where the checkpoint has one, is the executor's: it adds it in forward, as the C++ VirtLayer has it
(client_runtime/virtualize.cpp, virt_layer/virtual_weight.h); the module's own bias is dropped.

Inputs of any leading shape are flattened to [tokens, in] and cast to the layer's dtype (no copy
when they are contiguous and of that dtype already); results come back in the input's dtype.

`weight` of a virtual layer is a BaseWeightStandIn: the replaced weight's shape, dtype and device
(what PEFT reads to place its adapters), without its data (one NaN element, expanded: no memory).
Anything that needs the values (merging an adapter into the base, reading it) is refused naming the
layer, since the base lies on the executor. model.to(device or dtype) moves it.

PEFT's DoRA, which reads W for its weight norm, runs on a virtual layer all the same: building the
first virtual layer hooks PEFT's DoraLinearLayer (where PEFT is installed) so that, for a virtual
base layer only, it computes the norm and the base term through the executor instead
([DoRA on Python virtual layers], dora.py).
"""
import importlib.util
from typing import Callable, Optional

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from .client import Client, Error, LayerInfo

try:
    from transformers.pytorch_utils import Conv1D as _Conv1D
except ImportError:  # transformers is optional: then only torch.nn.Linear is virtualized
    _Conv1D = None


class _BaseLayerCall(torch.autograd.Function):
    """y = x·Wᵀ + b on the executor; grad_in = grad_out·W there too. x: [tokens, in], contiguous."""

    @staticmethod
    def forward(x, native, layer_id, with_bias):
        return native.forward(layer_id, x, with_bias)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, native, layer_id, _ = inputs
        ctx.native = native
        ctx.layer_id = layer_id

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        return ctx.native.backward_input(ctx.layer_id, grad_out.contiguous()), None, None, None


def base_layer(client: Client, layer: LayerInfo, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
    """The executor's layer applied to x [..., in_features], with autograd: [..., out_features]."""
    if x.dim() < 1 or x.shape[-1] != layer.in_features:
        raise Error(f"base layer {layer.name}: input has {x.shape[-1] if x.dim() else 0} features, "
                    f"expected {layer.in_features}")
    x2d = x.reshape(-1, layer.in_features).to(layer.dtype).contiguous()
    y = _BaseLayerCall.apply(x2d, client._native, layer.id, with_bias)
    return y.to(x.dtype).reshape(*x.shape[:-1], layer.out_features)


class BaseWeightStandIn(torch.Tensor):
    """A virtual layer's `weight`: what it is (shape, dtype, device) without what it holds, which lies
    on the executor. Asking what it is works; any computation with it raises symbiosis.Error naming
    the layer ([Python virtual layers])."""

    # What may be asked of it: facts about the tensor, never its values.
    _DESCRIBING = {
        "shape", "dtype", "device", "is_meta", "is_cuda", "is_cpu", "is_sparse", "is_quantized", "layout",
        "ndim", "requires_grad", "is_leaf", "names", "size", "dim", "numel", "element_size", "nelement",
        "is_floating_point", "is_complex", "is_contiguous", "stride", "__len__", "__format__", "__hash__",
        "get_device", "itemsize", "nbytes",
    }

    @staticmethod
    def make(placeholder: torch.Tensor, shape, layer_name: str) -> "BaseWeightStandIn":
        stand_in = torch.Tensor._make_subclass(BaseWeightStandIn, placeholder.expand(*shape), False)
        stand_in.layer_name = layer_name
        return stand_in

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", repr(func))
        if name in ("__get__", "__set__"):  # a property of the tensor: its descriptor's name
            name = getattr(getattr(func, "__self__", None), "__name__", name)
        if name == "__repr__":
            t = args[0]
            return (f"BaseWeightStandIn(layer '{t.layer_name}', shape={tuple(t.shape)}, dtype={t.dtype}, "
                    f"device={t.device}: the weight lies on the executor)")
        if name in cls._DESCRIBING:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        layer = next((a.layer_name for a in args if isinstance(a, BaseWeightStandIn)), "?")
        raise Error(f"base layer {layer}: its weight lies on the executor, and '{name}' needs its values, "
                    f"which this tenant never holds (merging an adapter into the base and other methods "
                    f"that read base weights cannot run on a virtual layer)")


_peft_dora_hooked = False


def _hook_peft_dora() -> None:
    """Where PEFT is installed, teaches its DoRA to run on virtual layers ([DoRA on Python virtual
    layers]); once, when the first virtual layer is built, so that importing symbiosis alone does not
    import PEFT."""
    global _peft_dora_hooked
    if not _peft_dora_hooked:
        if importlib.util.find_spec("peft") is not None:
            from .dora import hook_peft_dora

            hook_peft_dora()
        _peft_dora_hooked = True


def _placeholder(like: Optional[torch.Tensor], client: Client) -> torch.Tensor:
    dtype = like.dtype if like is not None else torch.float32
    device = like.device if like is not None and like.device.type != "meta" else client.device
    return torch.full((1,), float("nan"), dtype=dtype, device=device)


class VirtualLinear(nn.Linear):
    """A torch.nn.Linear whose weight and bias are the executor's ([Python virtual layers])."""

    def __init__(self, client: Client, layer: LayerInfo, like: Optional[torch.Tensor] = None):
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate the weight
        if layer.kind != "Linear":
            raise Error(f"layer {layer.name} is a {layer.kind}, not a Linear")
        _hook_peft_dora()
        self.in_features = layer.in_features
        self.out_features = layer.out_features
        self.register_parameter("bias", None)  # the executor adds it
        self.register_buffer("weight_stand_in", _placeholder(like, client), persistent=False)
        self.client = client
        self.layer = layer

    @property
    def weight(self) -> torch.Tensor:
        return BaseWeightStandIn.make(self.weight_stand_in, (self.out_features, self.in_features), self.layer.name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return base_layer(self.client, self.layer, x)

    def extra_repr(self) -> str:
        return (f"'{self.layer.name}', in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.layer.bias}, on the executor")


if _Conv1D is not None:

    class VirtualConv1D(_Conv1D):
        """A transformers Conv1D (GPT-2's; weight [in, out]) whose weight and bias are the executor's
        ([Python virtual layers])."""

        def __init__(self, client: Client, layer: LayerInfo, like: Optional[torch.Tensor] = None):
            nn.Module.__init__(self)  # not Conv1D's: it would allocate the weight
            if layer.kind != "Conv1D":
                raise Error(f"layer {layer.name} is a {layer.kind}, not a Conv1D")
            _hook_peft_dora()
            self.nx = layer.in_features
            self.nf = layer.out_features
            self.register_parameter("bias", None)
            self.register_buffer("weight_stand_in", _placeholder(like, client), persistent=False)
            self.client = client
            self.layer = layer

        @property
        def weight(self) -> torch.Tensor:
            return BaseWeightStandIn.make(self.weight_stand_in, (self.nx, self.nf), self.layer.name)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return base_layer(self.client, self.layer, x)

        def __repr__(self) -> str:
            return f"VirtualConv1D('{self.layer.name}', nf={self.nf}, nx={self.nx}, bias={self.layer.bias}, on the executor)"

else:  # pragma: no cover
    VirtualConv1D = None


def is_virtual(module: nn.Module) -> bool:
    """Whether `module` is a virtual layer (its base runs on the executor)."""
    return isinstance(module, VirtualLinear) or (VirtualConv1D is not None and isinstance(module, VirtualConv1D))


def _candidate_names(path: str, prefix: str):
    """Checkpoint names a module path may have: as is; inside a PEFT wrapper (base_model.model.,
    .base_layer); without or with the model's base_model_prefix (a checkpoint of the base model
    alone, e.g. GPT-2's Hub checkpoints, names its layers without "transformer.")."""
    if path.startswith("base_model.model."):
        path = path[len("base_model.model."):]
    if path.endswith(".base_layer"):
        path = path[: -len(".base_layer")]
    yield path
    if prefix:
        if path.startswith(prefix + "."):
            yield path[len(prefix) + 1:]
        else:
            yield prefix + "." + path


def _check_shape(path: str, module: nn.Module, layer: LayerInfo) -> None:
    if isinstance(module, nn.Linear):
        kind, shape = "Linear", (module.in_features, module.out_features)
    else:
        kind, shape = "Conv1D", (module.nx, module.nf)
    problem = None
    if layer.kind != kind:
        problem = f"it is a {kind}, the executor's layer {layer.name} is a {layer.kind}"
    elif shape != (layer.in_features, layer.out_features):
        problem = (f"it has in_features={shape[0]}, out_features={shape[1]}, the executor's layer "
                   f"{layer.name} has {layer.in_features}, {layer.out_features}")
    elif (module.bias is not None) != layer.bias:
        problem = (f"it {'has' if module.bias is not None else 'has no'} bias, the executor's layer "
                   f"{layer.name} {'has' if layer.bias else 'has none'}")
    if problem:
        raise Error(f"cannot virtualize module '{path}': {problem}")


def virtualize(
    model: nn.Module,
    client: Client,
    *,
    layer_name: Optional[Callable[[str], str]] = None,
    require_all: bool = False,
) -> int:
    """Replaces every torch.nn.Linear and transformers Conv1D of `model` whose module path names a
    layer `client`'s executor serves by a virtual layer ([Python virtual layers]); their local base
    weights are released. Returns how many were replaced.

    Module paths are matched against the executor's layer names as they are (model.named_modules():
    "model.layers.0.self_attn.q_proj"), also without or with the model's base_model_prefix and
    inside a PEFT wrapper; `layer_name` maps a path to a layer name instead. require_all: raise
    unless every layer the executor serves was found. Raises symbiosis.Error naming the module when
    a served layer's kind, shape or bias differs from the module's, and when nothing matched."""
    served = {layer.name: layer for layer in client.layers()}
    prefix = getattr(model, "base_model_prefix", "") or ""
    kinds = (nn.Linear,) if _Conv1D is None else (nn.Linear, _Conv1D)
    found = []
    for path, module in model.named_modules():
        if not path or not isinstance(module, kinds) or is_virtual(module):
            continue
        names = [layer_name(path)] if layer_name else _candidate_names(path, prefix)
        name = next((n for n in names if n in served), None)
        if name is not None:
            _check_shape(path, module, served[name])
            found.append((path, module, served[name]))
    for path, module, layer in found:
        parent_path, _, attribute = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        like = module.weight if isinstance(getattr(module, "weight", None), torch.Tensor) else None
        virtual_class = VirtualLinear if isinstance(module, nn.Linear) else VirtualConv1D
        setattr(parent, attribute, virtual_class(client, layer, like))
    bound = {layer.name for _, _, layer in found}
    if not bound:
        served_names = list(served)[:3]
        module_paths = [p for p, m in model.named_modules() if isinstance(m, kinds)][:3]
        raise Error(f"virtualize: no module of the model is a layer the executor serves (it serves "
                    f"{len(served)} layers, e.g. {served_names}; the model's linear layers are e.g. "
                    f"{module_paths}); pass layer_name= to map module paths to layer names")
    if require_all:
        missing = [name for name in served if name not in bound]
        if missing:
            raise Error(f"virtualize: the executor serves layer '{missing[0]}' "
                        f"({len(missing)} in all) but the model has no Linear or Conv1D of that name")
    return len(found)
