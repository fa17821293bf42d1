"""A Python tenant's transformers model, virtualized onto an executor, computes what the same model
computes in one process: logits, loss and every LoRA gradient (fp32, 1e-5), a PEFT training loop's
adapters after a few steps, and generate()'s tokens, for every architecture in conftest.ARCHITECTURES."""
import copy

import peft
import pytest
import torch

import symbiosis
from conftest import assert_close, lora, reference_model, tokens, train, trainable


def virtual_model(checkpoint, executor, tenant="pytest", transport="auto"):
    client = symbiosis.Client.connect(executor.endpoint, tenant=tenant, transport=transport)
    return symbiosis.from_pretrained(checkpoint, client, attn_implementation="eager"), client


def test_virtualized_holds_no_base_weight(architecture_served):
    _, checkpoint, executor = architecture_served
    model, client = virtual_model(checkpoint, executor)
    served = {layer.name for layer in client.layers()}
    virtual = [m for m in model.modules() if symbiosis.is_virtual(m)]
    assert len(virtual) == len(served)
    # No parameter or persistent buffer of the model is a base layer's weight or bias.
    state = model.state_dict()
    prefix = model.base_model_prefix + "."
    for name in served:
        for suffix in (".weight", ".bias"):
            assert name + suffix not in state and (prefix + name + suffix) not in state
    # Each virtual layer's weight is a stand-in of its shape over one element.
    for m in virtual:
        assert isinstance(m.weight, symbiosis.BaseWeightStandIn) and m.weight_stand_in.numel() == 1
        layer = m.layer
        shape = (layer.out_features, layer.in_features) if layer.kind == "Linear" else (layer.in_features, layer.out_features)
        assert tuple(m.weight.shape) == shape


def test_logits_loss_and_lora_gradients(architecture_served):
    architecture, checkpoint, executor = architecture_served
    reference = lora(reference_model(checkpoint))
    model, client = virtual_model(checkpoint, executor)
    model = lora(model)
    assert trainable(model).keys() == trainable(reference).keys()
    ids = tokens()
    expected = reference(ids, labels=ids)
    got = model(ids, labels=ids)
    assert_close(expected.logits, got.logits, f"{architecture} logits")
    assert_close(expected.loss, got.loss, f"{architecture} loss")
    expected.loss.backward()
    got.loss.backward()
    client.settle()
    want, have = trainable(reference), trainable(model)
    assert len(want) > 0
    for name in want:
        assert have[name].grad is not None, f"{architecture} {name}: no gradient"
        assert_close(want[name].grad, have[name].grad, f"{architecture} gradient of {name}")


def test_peft_training_loop_ends_at_the_same_adapter(architecture_served):
    architecture, checkpoint, executor = architecture_served
    reference = lora(reference_model(checkpoint))
    model, client = virtual_model(checkpoint, executor)
    model = lora(model)
    runs = [train(reference, None, 4), train(model, client, 4)]
    for step, (want, have) in enumerate(zip(*runs)):
        assert_close(want, have, f"{architecture} loss at step {step}")
    want = peft.get_peft_model_state_dict(reference)
    have = peft.get_peft_model_state_dict(model)
    assert want.keys() == have.keys()
    for name in want:
        # AdamW's first steps are sign-like: they enlarge the gradients' last-bit differences.
        assert_close(want[name], have[name], f"{architecture} adapter {name} after 4 steps", tolerance=1e-4)


def test_generate_gives_the_same_tokens(architecture_served):
    architecture, checkpoint, executor = architecture_served
    reference = lora(reference_model(checkpoint))
    model, _ = virtual_model(checkpoint, executor)
    model = lora(model)
    prompt = tokens(batch=1, length=5, seed=7)
    settings = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = reference.generate(input_ids=prompt, **settings)
        have = model.generate(input_ids=prompt, **settings)
    assert want.tolist() == have.tolist(), f"{architecture}: {want.tolist()} != {have.tolist()}"


def test_tcp_transport_is_exact_too(architecture_served):
    architecture, checkpoint, executor = architecture_served
    reference = reference_model(checkpoint)
    model, client = virtual_model(checkpoint, executor, transport="tcp")
    assert client.transport == "tcp"
    ids = tokens(seed=3)
    with torch.no_grad():
        assert_close(reference(ids).logits, model(ids).logits, f"{architecture} logits over tcp")


def test_virtualize_in_place_and_under_peft():
    """virtualize() on a model built as usual (its base weights then released), and on a model PEFT
    has already wrapped; both equal the reference."""
    from conftest import served

    with served("gpt2") as (checkpoint, executor):
        reference = lora(reference_model(checkpoint))
        client = symbiosis.Client.connect(executor.endpoint, tenant="in-place")
        plain = reference_model(checkpoint)
        assert symbiosis.virtualize(plain, client, require_all=True) == len(client.layers())
        plain = lora(plain)
        wrapped = lora(reference_model(checkpoint))
        assert symbiosis.virtualize(wrapped, client, require_all=True) == len(client.layers())
        ids = tokens()
        want = reference(ids, labels=ids)
        want.loss.backward()
        for model in (plain, wrapped):
            got = model(ids, labels=ids)
            assert_close(want.logits, got.logits, "logits")
            got.loss.backward()
            for name, p in trainable(reference).items():
                assert_close(p.grad, trainable(model)[name].grad, f"gradient of {name}")
        assert copy.deepcopy(plain) is not None  # a virtualized model can be copied (the client is shared)


@pytest.mark.parametrize("architecture", ["llama", "gemma2", "gpt2", "opt"])
def test_lm_head_served_too(architecture):
    """An executor started with --lm-head serves the output projection as well: it is virtualized
    like the other base layers, and LoRA on the rest stays exact. Gemma 2, GPT-2 and OPT tie their
    head to the input embeddings (their checkpoints have no lm_head.weight): the executor serves it
    from the embeddings ([Served tied head]), and the tenant keeps its embeddings, untied from the
    virtual head."""
    import tempfile

    from conftest import Executor, make_checkpoint

    with tempfile.TemporaryDirectory(prefix="symbiosis-py-lm-head-") as checkpoint:
        make_checkpoint(architecture, checkpoint)
        executor = Executor(checkpoint, ["--lm-head"])
        try:
            model, client = virtual_model(checkpoint, executor)
            assert client.layer("lm_head") is not None and symbiosis.is_virtual(model.lm_head)
            reference, model = lora(reference_model(checkpoint)), lora(model)
            ids = tokens()
            want, got = reference(ids, labels=ids), model(ids, labels=ids)
            assert_close(want.logits, got.logits, "logits")
            want.loss.backward()
            got.loss.backward()
            for name, p in trainable(reference).items():
                assert_close(p.grad, trainable(model)[name].grad, f"gradient of {name}")
        finally:
            executor.stop()
