"""The losses of Tinker's forward_backward, computed from the model's per-token log-probabilities.

[Tinker losses] Tinker names its losses and their inputs; the formulas are its documentation's
(tinker-docs.thinkingmachines.ai/losses; the SDK itself holds no loss math). For datum i,
lp = target_logprobs[i], log p(target_tokens[i][t] | input[:t+1]) under the model being trained;
slp = its `logprobs` input (the sampler's log-probabilities), A = its `advantages`, w = its
`weights`. Every loss is SUMMED over tokens and datums, never averaged: the client chooses its own
normalization through the weights and advantages it sends.

    cross_entropy        Σ −lp·w                                  (w any real number, negative too)
    importance_sampling  Σ −exp(lp − slp)·A
    ppo                  r = exp(lp − slp);  Σ −min(r·A, clamp(r, lo, hi)·A)
    cispo                r as above;         Σ −stopgrad(clamp(r, lo, hi))·lp·A
    dro                  Σ −(lp·A − ½·beta·(lp − slp)²)
    gspo                 s = exp(mean over M of (stopgrad(lp) − slp));  r_t = s·exp(lp_t − stopgrad(lp_t));
                         Σ −min(r·A, clamp(r, lo, hi)·A)   (GSPO-token: each token carries its sequence's
                         ratio s with its own log-probability's gradient)

`forward_backward_custom` in the SDK runs a user's loss on the client and sends its gradient back as
cross_entropy weights (−∂loss/∂lp), so cross_entropy must take negative weights.

gspo's sequence ratio averages over the tokens its optional `sequence_ratio_mask` input marks
(non-zero), all of the datum's tokens without one; its default clip range is the GSPO paper's
(1 − 3e-4, 1 + 4e-4: a sequence ratio moves far less than a token's). `stable_reinforce`, the SDK's
other name, has no published formula to hold it to, so it is refused like any unsupported loss.

ppo's and cispo's clip range comes from the config (`clip_low_threshold`, `clip_high_threshold`) or,
as the SDK also allows, per token from loss_fn_inputs of those names, which then win. Inputs a loss
does not read are ignored: clients keep their own bookkeeping in loss_fn_inputs (the cookbook's
`mask`) and Tinker's own recipes differ on whether they strip it.
"""
import math
from typing import Dict, List, Optional, Tuple

import torch

# loss_fn -> the loss_fn_inputs it reads besides target_tokens, and its config keys with their
# defaults (None: the key is required).
_LOSSES: Dict[str, Tuple[Tuple[str, ...], Dict[str, Optional[float]]]] = {
    "cross_entropy": (("weights",), {}),
    "importance_sampling": (("logprobs", "advantages"), {}),
    "ppo": (("logprobs", "advantages"), {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
    "cispo": (("logprobs", "advantages"), {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}),
    "dro": (("logprobs", "advantages"), {"beta": None}),
    "gspo": (("logprobs", "advantages"), {"clip_low_threshold": 1 - 3e-4, "clip_high_threshold": 1 + 4e-4}),
}

SUPPORTED_LOSSES: Tuple[str, ...] = tuple(_LOSSES)

# Inputs a loss reads when a datum carries them: ppo's and cispo's clip range per token, gspo's
# choice of the tokens its sequence ratio averages over.
_PER_TOKEN_CLIP = ("clip_low_threshold", "clip_high_threshold")
_OPTIONAL_INPUTS: Dict[str, Tuple[str, ...]] = {"ppo": _PER_TOKEN_CLIP, "cispo": _PER_TOKEN_CLIP,
                                                "gspo": ("sequence_ratio_mask",)}


def check_request(loss_fn: str, inputs: List[Dict[str, torch.Tensor]],
                  config: Optional[Dict[str, float]]) -> Dict[str, float]:
    """Checks a forward_backward request's loss half before any model work: loss_fn is supported,
    each datum carries the inputs it needs, one-dimensional and as long as its target_tokens, float
    inputs finite, config keys known. Returns the config with its defaults filled in. Raises
    ValueError naming the loss, the datum index and field, or the config key."""
    if loss_fn not in _LOSSES:
        raise ValueError(f"loss_fn '{loss_fn}' is not supported; supported: {', '.join(SUPPORTED_LOSSES)}")
    needed, defaults = _LOSSES[loss_fn]
    resolved = _resolve_config(loss_fn, config or {}, defaults)
    if not inputs:
        raise ValueError(f"{loss_fn}: no datums; expected at least one")
    optional = _OPTIONAL_INPUTS.get(loss_fn, ())
    for index, datum in enumerate(inputs):
        if "target_tokens" not in datum:
            raise ValueError(f"datum {index}: loss_fn_inputs has no 'target_tokens' ({loss_fn} needs "
                             f"{', '.join(('target_tokens',) + needed)})")
        targets = datum["target_tokens"]
        if targets.dim() != 1:
            raise ValueError(f"datum {index}: field 'target_tokens' has shape {list(targets.shape)}; "
                             f"expected one dimension [N]")
        expected = targets.shape[0]
        for field in needed + tuple(f for f in optional if f in datum):
            if field not in datum:
                raise ValueError(f"datum {index}: loss_fn_inputs has no '{field}' ({loss_fn} needs "
                                 f"{', '.join(('target_tokens',) + needed)})")
            value = datum[field]
            if value.dim() != 1 or value.shape[0] != expected:
                length = value.shape[0] if value.dim() == 1 else list(value.shape)
                raise ValueError(f"datum {index}: field '{field}' has length {length}, expected {expected} "
                                 f"(the length of target_tokens)")
            if not torch.isfinite(value).all():
                position = int((~torch.isfinite(value)).nonzero()[0, 0])
                raise ValueError(f"datum {index}: field '{field}' is {value[position].item()} at position "
                                 f"{position}; expected a finite number")
        if "sequence_ratio_mask" in optional and "sequence_ratio_mask" in datum and expected > 0 \
                and not (datum["sequence_ratio_mask"] != 0).any():
            raise ValueError(f"datum {index}: field 'sequence_ratio_mask' marks no token; expected at least one "
                             f"non-zero entry (the tokens gspo's sequence ratio averages over)")
    return resolved


def loss_of(loss_fn: str, target_logprobs: List[torch.Tensor], inputs: List[Dict[str, torch.Tensor]],
            config: Optional[Dict[str, float]]) -> Tuple[torch.Tensor, Dict[str, float]]:
    """The loss `loss_fn` ([Tinker losses]) of a batch, summed over tokens and datums, and its metrics
    (keys `name:reduction`, as the SDK combines them across chunks; at least "loss:sum").

    target_logprobs[i]: datum i's [N_i] log-probabilities of its target tokens (requiring grad when
    training); inputs[i]: its loss_fn_inputs as tensors; config: loss_fn_config. The loss is computed
    in target_logprobs' dtype, on their device. Raises ValueError as check_request does, and when a
    datum's target_logprobs are not as long as its target_tokens."""
    resolved = check_request(loss_fn, inputs, config)
    if len(target_logprobs) != len(inputs):
        raise ValueError(f"{loss_fn}: {len(target_logprobs)} target_logprobs for {len(inputs)} datums")
    total = None
    for index, (logprobs, datum) in enumerate(zip(target_logprobs, inputs)):
        expected = datum["target_tokens"].shape[0]
        if logprobs.dim() != 1 or logprobs.shape[0] != expected:
            raise ValueError(f"datum {index}: target_logprobs have shape {list(logprobs.shape)}, expected "
                             f"[{expected}] (the length of target_tokens)")
        field = {name: value.to(device=logprobs.device, dtype=logprobs.dtype)
                 for name, value in datum.items() if name != "target_tokens"}
        datum_loss = _datum_loss(loss_fn, logprobs, field, resolved)
        total = datum_loss if total is None else total + datum_loss
    return total, {"loss:sum": float(total.detach().item())}


def _datum_loss(loss_fn: str, lp: torch.Tensor, inputs: Dict[str, torch.Tensor],
                config: Dict[str, float]) -> torch.Tensor:
    """One datum's summed loss ([Tinker losses]); inputs already in lp's dtype and device."""
    if loss_fn == "cross_entropy":
        return -(lp * inputs["weights"]).sum()
    sampler_lp, advantages = inputs["logprobs"], inputs["advantages"]
    if loss_fn == "dro":
        return -(lp * advantages - 0.5 * config["beta"] * (lp - sampler_lp) ** 2).sum()
    if loss_fn == "gspo":
        mask = inputs.get("sequence_ratio_mask")
        in_ratio = torch.ones_like(lp, dtype=torch.bool) if mask is None else mask != 0
        log_ratio = (lp.detach() - sampler_lp)[in_ratio].mean()
        ratio = torch.exp(log_ratio + lp - lp.detach())
    else:
        ratio = torch.exp(lp - sampler_lp)
    if loss_fn == "importance_sampling":
        return -(ratio * advantages).sum()
    low = inputs.get("clip_low_threshold", config["clip_low_threshold"])
    high = inputs.get("clip_high_threshold", config["clip_high_threshold"])
    if isinstance(low, torch.Tensor) or isinstance(high, torch.Tensor):  # a range per token
        as_tensor = lambda bound: torch.as_tensor(bound, dtype=lp.dtype, device=lp.device)  # noqa: E731
        clipped = torch.minimum(torch.maximum(ratio, as_tensor(low)), as_tensor(high))
    else:
        clipped = ratio.clamp(low, high)
    if loss_fn in ("ppo", "gspo"):
        return -torch.minimum(ratio * advantages, clipped * advantages).sum()
    if loss_fn == "cispo":
        return -(clipped.detach() * lp * advantages).sum()
    raise AssertionError(f"loss_fn '{loss_fn}' is in _LOSSES but has no formula")


def _resolve_config(loss_fn: str, config: Dict[str, float], defaults: Dict[str, Optional[float]]) -> Dict[str, float]:
    """config's values as floats over the loss's defaults; refuses unknown keys, a missing
    required key, a non-finite value and an empty clip range, naming the key."""
    unknown = sorted(set(config) - set(defaults))
    if unknown:
        accepted = ", ".join(sorted(defaults)) if defaults else "none"
        raise ValueError(f"loss_fn_config for {loss_fn} has unknown keys {', '.join(unknown)}; "
                         f"accepted keys: {accepted}")
    resolved = {}
    for key, default in defaults.items():
        if key not in config or config[key] is None:
            if default is None:
                raise ValueError(f"loss_fn_config for {loss_fn} needs '{key}' (a number); it is missing")
            resolved[key] = default
            continue
        try:
            value = float(config[key])
        except (TypeError, ValueError):
            raise ValueError(f"loss_fn_config for {loss_fn}: '{key}' is {config[key]!r}; expected a number") from None
        if not math.isfinite(value):
            raise ValueError(f"loss_fn_config for {loss_fn}: '{key}' is {value}; expected a finite number")
        resolved[key] = value
    if "beta" in resolved and resolved["beta"] < 0:
        raise ValueError(f"loss_fn_config for {loss_fn}: 'beta' is {resolved['beta']}; expected beta >= 0")
    if "clip_low_threshold" in resolved and resolved["clip_low_threshold"] > resolved["clip_high_threshold"]:
        raise ValueError(f"loss_fn_config for {loss_fn}: 'clip_low_threshold' {resolved['clip_low_threshold']} is "
                         f"above 'clip_high_threshold' {resolved['clip_high_threshold']}; expected low <= high")
    return resolved
