"""What users stack on a virtualized model works and stays exact: PEFT's methods beside LoRA (IA3,
AdaLoRA, prompt and prefix tuning), gradient checkpointing, torch.compile, transformers' Trainer."""
import tempfile

import peft
import pytest
import torch

import symbiosis
from conftest import assert_close, reference_model, served, tokens


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def executor_of(request):
    """(checkpoint, executor) serving a tiny model (Llama: Linear; GPT-2: Conv1D)."""
    with served(request.param) as (checkpoint, executor):
        yield checkpoint, executor


@pytest.fixture(scope="module")
def tenant(executor_of):
    """(checkpoint, client) of a tenant of that executor."""
    checkpoint, executor = executor_of
    return checkpoint, symbiosis.Client.connect(executor.endpoint, tenant="composition")


def virtual(checkpoint, client):
    return symbiosis.from_pretrained(checkpoint, client, attn_implementation="eager")


def assert_same_step(reference, model, client, what, run=None):
    """One forward and backward of each (of `model` through `run` when given): equal logits, loss
    and trainable gradients."""
    ids = tokens()
    want, got = reference(ids, labels=ids), (model if run is None else run)(ids, labels=ids)
    assert_close(want.logits, got.logits, f"{what} logits")
    assert_close(want.loss, got.loss, f"{what} loss")
    want.loss.backward()
    got.loss.backward()
    client.settle()
    have = {n: p for n, p in model.named_parameters() if p.requires_grad}
    count = 0
    for name, p in reference.named_parameters():
        if p.requires_grad:
            assert have[name].grad is not None, f"{what}: {name} has no gradient"
            assert_close(p.grad, have[name].grad, f"{what} gradient of {name}")
            count += 1
    assert count > 0


PEFT_METHODS = {
    "ia3": lambda: peft.IA3Config(target_modules="all-linear", feedforward_modules=[]),
    "adalora": lambda: peft.AdaLoraConfig(target_modules="all-linear", total_step=10, init_r=4, target_r=2),
    "prompt_tuning": lambda: peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
    "prefix_tuning": lambda: peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
}


@pytest.mark.parametrize("method", sorted(PEFT_METHODS))
def test_peft_method_is_exact(tenant, method):
    checkpoint, client = tenant
    models = []
    for base in (reference_model(checkpoint), virtual(checkpoint, client)):
        torch.manual_seed(1)
        models.append(peft.get_peft_model(base, PEFT_METHODS[method]()))
    assert_same_step(*models, client, method)


def test_gradient_checkpointing_is_exact(tenant):
    checkpoint, client = tenant
    models = []
    for base in (reference_model(checkpoint), virtual(checkpoint, client)):
        torch.manual_seed(1)
        model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()  # checkpointing applies in training mode (the configs have no dropout)
        models.append(model)
    calls = client.calls
    assert_same_step(*models, client, "gradient checkpointing")
    # The recomputed forward called the executor again: forward, recomputed forward, backward.
    layers = len(client.layers())
    assert client.calls - calls == 3 * layers


def test_torch_compile_is_exact(tenant):
    """torch.compile (AOTAutograd, without inductor's C++ compilation, which is slow on a CPU test
    machine): Dynamo runs the base-layer calls eagerly between the graphs it compiles."""
    checkpoint, client = tenant
    torch._dynamo.reset()
    models = []
    for base in (reference_model(checkpoint), virtual(checkpoint, client)):
        torch.manual_seed(1)
        models.append(peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)))
    reference, model = models
    compiled = torch.compile(model, backend="aot_eager")
    assert_same_step(reference, model, client, "torch.compile", run=compiled)


def test_transformers_trainer_ends_at_the_same_adapter(tenant):
    import transformers

    checkpoint, client = tenant
    data = [{"input_ids": ids, "labels": ids} for ids in tokens(batch=8, length=9, seed=5)]
    adapters = []
    for base in (reference_model(checkpoint), virtual(checkpoint, client)):
        torch.manual_seed(1)
        model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
        with tempfile.TemporaryDirectory() as out:
            args = transformers.TrainingArguments(
                output_dir=out, per_device_train_batch_size=2, max_steps=3, learning_rate=1e-2,
                use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no", seed=0,
                dataloader_num_workers=0, disable_tqdm=True)
            transformers.Trainer(model=model, args=args, train_dataset=data).train()
        adapters.append(peft.get_peft_model_state_dict(model))
    want, have = adapters
    assert want.keys() == have.keys()
    for name in want:
        assert_close(want[name], have[name], f"adapter {name} after 3 Trainer steps", tolerance=1e-4)


def test_generate_as_an_inference_tenant(tenant):
    """generate() with the client's calls in the decode latency class gives the same tokens; the
    class is restored after."""
    checkpoint, client = tenant
    reference, model = reference_model(checkpoint), virtual(checkpoint, client)
    prompt = tokens(batch=2, length=4, seed=11)
    settings = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        want = reference.generate(input_ids=prompt, **settings)
        with client.latency("decode"):
            assert client.latency_class == "decode"
            have = model.generate(input_ids=prompt, **settings)
    assert client.latency_class == "finetune"
    assert want.tolist() == have.tolist()


@pytest.mark.parametrize("effects", ["executor", "tenant"])
def test_masked_tenant_is_exact(executor_of, effects):
    """[Noise masking] (docs/privacy.md) from Python: the executor sees only masked activations and
    gradients, the noise's effects computed by the executor or by this process from the checkpoint;
    LoRA's logits, loss and gradients stay within 1e-5 of the reference."""
    from test_exactness import lora

    checkpoint, executor = executor_of
    client = symbiosis.Client.connect(executor.endpoint, tenant="masked", mask=True, mask_secret=7,
                                      mask_effects_checkpoint=checkpoint if effects == "tenant" else "")
    assert client.masked
    reference, model = lora(reference_model(checkpoint)), lora(virtual(checkpoint, client))
    assert_same_step(reference, model, client, f"masked ({effects} computes the effects)")
