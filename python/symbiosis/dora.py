"""DoRA (PEFT's LoraConfig(use_dora=True)) on virtual layers.

[DoRA on Python virtual layers]
PEFT's DoraLinearLayer reads the base weight W in two places: for its weight norm ‖W + s·B·A‖ (per
output o, when the adapter is set up, update_layer, and in every forward) and, when LoRA dropout is
active in training (PEFT then passes base_result=None), for the base term x·Wᵀ without bias. A
virtual layer's W lies on the executor, so hook_peft_dora() wraps those two methods: for a virtual
base layer they compute the same without W, as the C++ DoraAdapterImpl does ([DoRA norms on the
executor], client_runtime/peft/dora.h). With M the layer's map x ↦ x·M (Wᵀ for Linear, W for
Conv1D, so both kinds are handled alike),
    n_o² = ‖M[:,o]‖² + 2s·Σ_j B[o,j]·(A·M)[j,o] + s²·B_o·(A·Aᵀ)·B_oᵀ,
summed in float64 (the terms may nearly cancel) and rounded to the dtype PEFT's norm has.
‖M[:,o]‖² is found once per layer by streaming chunks of the identity through the executor without
bias (I·M gives rows of M; only NORM_CHUNK_ROWS of them are held at a time) and cached with the
layer's bias (one call on a zero row), which PEFT subtracts from the base result. Each norm then
costs one no-bias call on A's r rows; the base term, where PEFT needs it, is one no-bias call with
autograd, as PEFT's F.linear(x, W). PEFT's direct norm differs from the expansion by rounding only.

For every other base layer PEFT's own methods run, unchanged. Merging a DoRA adapter into the base
still reads W through the stand-in and stays refused ([Python virtual layers]).
"""
import functools
import weakref
from typing import NamedTuple, Optional

import torch
from peft.tuners.lora.dora import DoraLinearLayer, cache_decorator

from . import virtual

# Identity rows per no-bias call when streaming a layer's column norms: bounds the tenant's memory to
# a few of W's rows while keeping the call count at in/256 (the C++ kNormChunkRows).
NORM_CHUNK_ROWS = 256


class _BaseFacts(NamedTuple):
    """What DoRA needs of a virtual layer's base, found once: ‖M[:,o]‖² and the bias."""

    column_norms_squared: torch.Tensor  # [out], float64
    bias: Optional[torch.Tensor]  # [out] in the layer's dtype, or None


# Keyed by the virtual layer; an entry goes with its layer.
_base_facts_of: "weakref.WeakKeyDictionary[torch.nn.Module, _BaseFacts]" = weakref.WeakKeyDictionary()


def _base_facts(module: torch.nn.Module) -> _BaseFacts:
    facts = _base_facts_of.get(module)
    if facts is not None:
        return facts
    client, layer = module.client, module.layer
    options = dict(dtype=layer.dtype, device=client.device)
    with torch.no_grad():
        norms = torch.zeros(layer.out_features, dtype=torch.float64, device=client.device)
        for first in range(0, layer.in_features, NORM_CHUNK_ROWS):
            rows = min(NORM_CHUNK_ROWS, layer.in_features - first)
            identity_rows = torch.zeros(rows, layer.in_features, **options)
            identity_rows[:, first:first + rows] = torch.eye(rows, **options)
            norms += client.forward(layer, identity_rows, with_bias=False).to(torch.float64).square().sum(0)
        bias = client.forward(layer, torch.zeros(1, layer.in_features, **options))[0] if layer.bias else None
    facts = _BaseFacts(norms, bias)
    _base_facts_of[module] = facts
    return facts


def virtual_weight_norm(module: torch.nn.Module, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float,
                        dtype: torch.dtype) -> torch.Tensor:
    """‖W + s·B·A‖ per output row of the virtual layer `module`, [out] in `dtype` on lora_A's device,
    without autograd ([DoRA on Python virtual layers]). lora_A: [r, in]; lora_B: [out, r]."""
    with torch.no_grad():
        a = lora_A.detach()
        a_map = virtual.base_layer(module.client, module.layer, a, with_bias=False)  # [r, out] = A·M
        a, b, a_map = (t.to(device=a.device, dtype=torch.float64) for t in (a, lora_B.detach(), a_map))
        column_norms_squared = _base_facts(module).column_norms_squared.to(a.device)
        cross = (b * a_map.t()).sum(1)
        lora_squared = ((b @ (a @ a.t())) * b).sum(1)
        norm_squared = column_norms_squared + 2 * scaling * cross + scaling * scaling * lora_squared
        return norm_squared.clamp_min(0).sqrt().to(dtype)


@cache_decorator("weight-norm")  # PEFT's cache of the norm in eval (peft.tuners.lora.dora.ENABLE_DORA_CACHING)
def _cached_weight_norm(dora: DoraLinearLayer, module, lora_A, lora_B, scaling, dtype, adapter_name=None):
    return virtual_weight_norm(module, lora_A, lora_B, scaling, dtype)


def _virtual_update_layer(dora: DoraLinearLayer, *, base_layer, lora_A, lora_B, scaling, place_on_cpu=False):
    # PEFT's norm has the dtype of W + s·B·A.
    dtype = torch.promote_types(base_layer.weight.dtype, lora_A.dtype)
    weight_norm = virtual_weight_norm(base_layer, lora_A, lora_B, scaling, dtype)
    if place_on_cpu:
        weight_norm = weight_norm.to("cpu")
    dora.weight = torch.nn.Parameter(weight_norm, requires_grad=True)


def _virtual_forward(dora: DoraLinearLayer, x, *, lora_A, lora_B, scaling, base_layer, base_result=None,
                     adapter_name="default"):
    weight_norm = _cached_weight_norm(dora, base_layer, lora_A.weight, lora_B.weight, scaling, x.dtype,
                                      adapter_name=adapter_name)
    mag_norm_scale = (dora.weight / weight_norm).view(1, -1)  # the norm is detached (DoRA §4.3)
    lora_result = lora_B(lora_A(x))
    if base_result is None:  # LoRA dropout is active: the base term sees the dropped input too
        base_result = virtual.base_layer(base_layer.client, base_layer.layer, x, with_bias=False)
    else:
        bias = _base_facts(base_layer).bias
        if bias is not None:
            base_result = base_result - bias.to(base_result.device, base_result.dtype)
    return (mag_norm_scale - 1) * base_result + mag_norm_scale * lora_result * scaling


def hook_peft_dora() -> None:
    """Wraps DoraLinearLayer.update_layer and .forward so that a virtual base layer takes the paths
    above and every other base layer PEFT's own ([DoRA on Python virtual layers]). Idempotent."""
    if getattr(DoraLinearLayer, "_symbiosis_hooked", False):
        return
    peft_update_layer, peft_forward = DoraLinearLayer.update_layer, DoraLinearLayer.forward

    @functools.wraps(peft_update_layer)
    def update_layer(self, *, base_layer, **kwargs):
        if virtual.is_virtual(base_layer):
            return _virtual_update_layer(self, base_layer=base_layer, **kwargs)
        return peft_update_layer(self, base_layer=base_layer, **kwargs)

    @functools.wraps(peft_forward)
    def forward(self, x, *, base_layer, **kwargs):
        if virtual.is_virtual(base_layer):
            return _virtual_forward(self, x, base_layer=base_layer, **kwargs)
        return peft_forward(self, x, base_layer=base_layer, **kwargs)

    DoraLinearLayer.update_layer = update_layer
    DoraLinearLayer.forward = forward
    DoraLinearLayer._symbiosis_hooked = True
