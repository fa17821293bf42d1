"""Refusals reach a Python tenant as symbiosis.Error (a RuntimeError) whose message names what was
wrong and what was expected: the executor's errors, the client's option checks, virtualize() and
load_weights()."""
import peft
import pytest
import torch
import transformers

import symbiosis
from conftest import served, tokens


@pytest.fixture(scope="module")
def llama():
    with served("llama") as (checkpoint, executor):
        yield checkpoint, executor


def refused(call, *words):
    with pytest.raises(symbiosis.Error) as raised:
        call()
    message = str(raised.value)
    for word in words:
        assert word in message, f"{message!r} does not name {word!r}"
    return message


def test_connect_refusals_name_the_option(llama):
    _, executor = llama
    refused(lambda: symbiosis.Client.connect("tcp://127.0.0.1:1", connect_timeout_ms=500),
            "tcp://127.0.0.1:1", "did not answer")
    refused(lambda: symbiosis.Client.connect(executor.endpoint, transport="carrier-pigeon"),
            "transport", "carrier-pigeon", "tcp, shm")
    refused(lambda: symbiosis.Client.connect(executor.endpoint, device="tpu"), "device", "tpu", "cpu or cuda:N")
    refused(lambda: symbiosis.Client.connect(executor.endpoint, latency_class="urgent"),
            "urgent", "finetune, prefill, decode")
    refused(lambda: symbiosis.Client.connect(executor.endpoint, timeout_ms=0), "timeout_ms", "positive")
    refused(lambda: symbiosis.Client.connect(executor.endpoint, mask=True, noise_ratio=-1), "noise_ratio", "positive")
    refused(lambda: symbiosis.Client.connect(executor.endpoint, expected_model_hash="0123abcd"),
            "model mismatch", "0123abcd")


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_executor_refusals_name_the_layer_and_the_shape(llama, transport):
    _, executor = llama
    client = symbiosis.Client.connect(executor.endpoint, transport=transport)
    layer = client.layers()[0]
    refused(lambda: client.forward(layer, torch.zeros(3, layer.in_features + 1)),
            layer.name, f"[tokens, {layer.in_features}]", f"[3, {layer.in_features + 1}]")
    refused(lambda: client.forward(layer, torch.zeros(3, layer.in_features, dtype=torch.float64)),
            layer.name, "Double")
    refused(lambda: client.backward_input(layer, torch.zeros(2, layer.in_features + layer.out_features)),
            layer.name, f"[tokens, {layer.out_features}]")
    refused(lambda: client.forward(999, torch.zeros(3, layer.in_features)), "999", "0..")
    refused(lambda: client.forward("model.nothing", torch.zeros(3, layer.in_features)), "model.nothing")
    # The connection still serves after its refusals.
    y = client.forward(layer, torch.ones(3, layer.in_features))
    assert y.shape == (3, layer.out_features)


def test_virtualize_refusals_name_the_module(llama):
    checkpoint, executor = llama
    client = symbiosis.Client.connect(executor.endpoint)
    config = transformers.AutoConfig.from_pretrained(checkpoint)
    config.intermediate_size += 16
    other = transformers.AutoModelForCausalLM.from_config(config)
    refused(lambda: symbiosis.virtualize(other, client), "cannot virtualize module 'model.layers.0.mlp.", "out_features")
    refused(lambda: symbiosis.virtualize(torch.nn.Sequential(torch.nn.Linear(2, 2)), client),
            "no module of the model is a layer the executor serves", "layer_name=")
    partial = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(checkpoint))
    partial.model.layers[1].mlp.down_proj = torch.nn.Identity()
    refused(lambda: symbiosis.virtualize(partial, client, require_all=True), "model.layers.1.mlp.down_proj")
    biased = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(checkpoint))
    biased.model.layers[0].self_attn.q_proj = torch.nn.Linear(config.hidden_size, config.hidden_size, bias=True)
    refused(lambda: symbiosis.virtualize(biased, client), "model.layers.0.self_attn.q_proj", "bias")


def test_load_weights_refuses_what_no_checkpoint_has(llama):
    checkpoint, executor = llama
    client = symbiosis.Client.connect(executor.endpoint)
    config = transformers.AutoConfig.from_pretrained(checkpoint)
    # Built under torch.device("meta"), the rotary frequencies (a buffer __init__ computes) are in no checkpoint.
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    symbiosis.virtualize(model, client)
    refused(lambda: symbiosis.load_weights(model, checkpoint), "inv_freq", "symbiosis.empty_parameters()")
    refused(lambda: symbiosis.load_weights(model, "/nonexistent"), "model.safetensors")


def test_what_needs_the_base_weight_is_refused(llama):
    checkpoint, executor = llama
    client = symbiosis.Client.connect(executor.endpoint)
    model = symbiosis.from_pretrained(checkpoint, client)
    q_proj = model.model.layers[0].self_attn.q_proj
    assert q_proj.weight.shape == (q_proj.out_features, q_proj.in_features)  # what it is may be asked
    # What needs its values (it lies on the executor) is refused naming the layer.
    refused(lambda: q_proj.weight.add_(1), "model.layers.0.self_attn.q_proj", "lies on the executor", "add_")
    refused(lambda: q_proj.weight.sum(), "model.layers.0.self_attn.q_proj", "sum")
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj"]))
    refused(lambda: lora.merge_and_unload(), "model.layers.0.self_attn.q_proj", "merging an adapter")
    # DoRA trains on a virtual layer (test_dora.py), but its merge reads the base weight too.
    dora = peft.LoraConfig(r=4, use_dora=True, target_modules=["q_proj"])
    dora = peft.get_peft_model(symbiosis.from_pretrained(checkpoint, client), dora)
    refused(lambda: dora.merge_and_unload(), "model.layers.0.self_attn.q_proj", "merging an adapter")
    model = symbiosis.from_pretrained(checkpoint, client)
    # The executor's layers are frozen: a second derivative through them is refused.
    ids = tokens()
    embeddings = model.model.embed_tokens.weight
    embeddings.requires_grad_(True)
    (grad,) = torch.autograd.grad(model(ids).logits.sum(), [embeddings], create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        grad.sum().backward()


def test_a_lost_executor_is_an_error_naming_it():
    with served("llama") as (checkpoint, executor):
        client = symbiosis.Client.connect(executor.endpoint, reconnect_ms=0, transport="tcp")
        layer = client.layers()[0]
        client.forward(layer, torch.ones(2, layer.in_features))
        executor.stop()
        message = refused(lambda: client.forward(layer, torch.ones(2, layer.in_features)))
        assert "executor" in message, message


def test_from_pretrained_refuses_another_checkpoint(llama, tmp_path):
    from conftest import make_checkpoint

    _, executor = llama
    other = make_checkpoint("llama", str(tmp_path), seed=1)  # same shapes, other weights
    client = symbiosis.Client.connect(executor.endpoint)
    refused(lambda: symbiosis.from_pretrained(other, client), client.model_hash,
            symbiosis.model_hash(other), "the checkpoint the executor serves")
    refused(lambda: symbiosis.Client.connect(executor.endpoint, expected_model_hash=symbiosis.model_hash(other)),
            "model mismatch")
