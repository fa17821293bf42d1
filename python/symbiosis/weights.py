"""Building a tenant's model without its base weights.

[Base never in the tenant]
A tenant needs the model's code and its non-base weights (embeddings, norms, and whatever the
executor does not serve), never the base layers' weights. So:

    with symbiosis.empty_parameters():               # parameters on the meta device: no memory
        model = AutoModelForCausalLM.from_config(config)
    symbiosis.virtualize(model, client)               # base layers -> the executor's
    symbiosis.load_weights(model, checkpoint_dir)     # the rest, read from the checkpoint's safetensors

or all three at once: symbiosis.from_pretrained(checkpoint_dir, client). empty_parameters() puts
parameters on the meta device as they are registered (before their initialization runs, so that
costs nothing either) and leaves buffers (rotary frequencies and the like, which __init__ computes)
as they are made; a plain `with torch.device("meta")` would make those meta too, and they are in no
checkpoint. load_weights() reads only the tensors the model still lacks (safetensors reads a tensor
alone from its file) and refuses to leave any parameter on the meta device, naming it.
"""
import contextlib
import json
import os
from typing import Dict, Optional, Union

import torch
from torch import nn

from .client import Client, Error, model_hash
from .virtual import is_virtual, virtualize


@contextlib.contextmanager
def empty_parameters():
    """Inside, every parameter a module registers is put on the meta device at once (before the
    module initializes it); buffers are made as usual. See [Base never in the tenant]."""
    original = nn.Module.register_parameter

    def register_parameter(module, name, param):
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            kwargs = dict(param.__dict__)
            kwargs["requires_grad"] = param.requires_grad
            module._parameters[name] = type(param)(param.to("meta"), **kwargs)

    nn.Module.register_parameter = register_parameter
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def _checkpoint_files(checkpoint: str):
    index = os.path.join(checkpoint, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return sorted({os.path.join(checkpoint, file) for file in weight_map.values()})
    single = os.path.join(checkpoint, "model.safetensors")
    if os.path.exists(single):
        return [single]
    raise Error(f"load_weights: {checkpoint} has neither model.safetensors nor model.safetensors.index.json")


def _meta_tensors(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The model's parameters and buffers still on the meta device, by their state_dict names."""
    found = {}
    for name, tensor in list(model.named_parameters(remove_duplicate=False)) + list(
        model.named_buffers(remove_duplicate=False)
    ):
        if tensor.device.type == "meta":
            found[name] = tensor
    return found


def load_weights(model: nn.Module, checkpoint: str, *, device: Union[str, torch.device, None] = None) -> int:
    """Loads from `checkpoint` (a Hugging Face checkpoint folder: model.safetensors or its sharded
    index) every parameter and buffer of `model` still on the meta device, on `device` (default:
    cpu) in the dtype the model declares; nothing else is read. Ties the model's tied weights
    again afterwards. Returns how many tensors were loaded. Raises symbiosis.Error naming what the
    checkpoint lacks. See [Base never in the tenant]."""
    from safetensors import safe_open

    device = torch.device(device or "cpu")
    wanted = _meta_tensors(model)
    prefix = getattr(model, "base_model_prefix", "") or ""
    state = {}
    for file in _checkpoint_files(checkpoint):
        with safe_open(file, framework="pt", device=str(device)) as f:
            keys = set(f.keys())
            for name, like in wanted.items():
                if name in state:
                    continue
                candidates = [name]
                if prefix and name.startswith(prefix + "."):
                    candidates.append(name[len(prefix) + 1:])
                elif prefix:
                    candidates.append(prefix + "." + name)
                key = next((c for c in candidates if c in keys), None)
                if key is not None:
                    state[name] = f.get_tensor(key).to(like.dtype)
    if state:
        model.load_state_dict(state, strict=False, assign=True)
    # assign=True replaced tied parameters on one side only: tie them again, but for a head the
    # executor serves from the embeddings ([Served tied head] in base_executor/base_model.cpp).
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if hasattr(model, "tie_weights") and not (head is not None and is_virtual(head)):
        model.tie_weights()
    left = _meta_tensors(model)
    if left:
        names = sorted(left)
        raise Error(f"load_weights: {len(names)} tensor(s) of the model are in no file of {checkpoint} and no "
                    f"layer the executor serves, e.g. {names[:4]} (a buffer made under torch.device('meta') is "
                    f"never in a checkpoint: build the model under symbiosis.empty_parameters() instead)")
    return len(state)


def from_pretrained(
    checkpoint: str,
    client: Client,
    *,
    dtype: torch.dtype = torch.float32,
    model_class=None,
    check_model_hash: bool = True,
    **from_config_kwargs,
):
    """A transformers model of `checkpoint` (default class: AutoModelForCausalLM) whose base layers
    are `client`'s executor's, built without ever holding their weights ([Base never in the
    tenant]); every layer the executor serves must be found in it. check_model_hash: refuse unless
    the executor serves this very checkpoint (its non-base weights would not fit another's base).
    Extra keyword arguments go to from_config (e.g. attn_implementation="eager")."""
    import transformers

    if check_model_hash:
        expected = model_hash(checkpoint)
        if client.model_hash != expected:
            raise Error(f"from_pretrained: the executor serves model {client.model_hash}, but checkpoint "
                        f"{checkpoint} is model {expected}: the tenant's non-base weights must come from "
                        f"the checkpoint the executor serves")

    model_class = model_class or transformers.AutoModelForCausalLM
    config = transformers.AutoConfig.from_pretrained(checkpoint)
    with empty_parameters():
        model = model_class.from_config(config, dtype=dtype, **from_config_kwargs)
    virtualize(model, client, require_all=True)
    load_weights(model, checkpoint, device=client.device)
    # The buffers __init__ computed (rotary frequencies) were made on the CPU: the whole model on the
    # client's device, where its activations must be for the executor's transport (cuda-ipc, nccl).
    model.to(client.device)
    model.eval()
    return model
