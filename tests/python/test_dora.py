"""PEFT's DoRA (LoraConfig(use_dora=True)) on a Python tenant's virtual layers ([DoRA on Python
virtual layers], python/symbiosis/dora.py) computes what the same PEFT DoRA model computes on the
full local transformers model: the magnitude vectors it starts from, logits, loss and the gradient of
every adapter tensor (fp32, 1e-5), the adapters after a few AdamW steps, with LoRA dropout (PEFT then
computes the base term itself) and without; and what save_pretrained writes loads in plain PEFT on
the local model. Qwen2 (Linear layers with and without a bias) and GPT-2 (Conv1D)."""
import peft
import pytest
import torch

import symbiosis
import symbiosis.dora
from conftest import assert_close, reference_model, served, tokens, train, trainable


@pytest.fixture(scope="module", params=["qwen2", "gpt2"])
def dora_served(request):
    with served(request.param) as (checkpoint, executor):
        yield request.param, checkpoint, executor


def dora(model, dropout=0.0, seed=1):
    # init_lora_weights=False: B is random too, so the norm's cross terms and every gradient are non-zero.
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules="all-linear",
                             use_dora=True, init_lora_weights=False)
    return peft.get_peft_model(model, config)


def virtual_model(checkpoint, executor):
    client = symbiosis.Client.connect(executor.endpoint, tenant="dora")
    return symbiosis.from_pretrained(checkpoint, client, attn_implementation="eager"), client


def magnitudes(model):
    return {name: p for name, p in trainable(model).items() if "lora_magnitude_vector" in name}


def test_magnitudes_start_at_the_weight_norm(dora_served, monkeypatch):
    architecture, checkpoint, executor = dora_served
    # Chunks of 7 identity rows: the layers' 32 and 64 inputs end in a partial chunk.
    monkeypatch.setattr(symbiosis.dora, "NORM_CHUNK_ROWS", 7)
    reference = dora(reference_model(checkpoint))
    model, _ = virtual_model(checkpoint, executor)
    model = dora(model)
    want, have = magnitudes(reference), magnitudes(model)
    assert len(want) > 0 and want.keys() == have.keys()
    for name in want:
        assert_close(want[name], have[name], f"{architecture} {name} at the start")


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_training_matches_the_local_model(dora_served, dropout):
    architecture, checkpoint, executor = dora_served
    what = f"{architecture}, lora_dropout={dropout}"
    reference = dora(reference_model(checkpoint), dropout)
    model, client = virtual_model(checkpoint, executor)
    model = dora(model, dropout)
    assert trainable(model).keys() == trainable(reference).keys()
    def record(out, m):
        return out.logits.detach(), out.loss.detach(), {name: p.grad.clone() for name, p in trainable(m).items()}

    runs = [train(reference, None, 3, record), train(model, client, 3, record)]
    (want_logits, _, want_grads), (have_logits, _, have_grads) = runs[0][0], runs[1][0]
    assert_close(want_logits, have_logits, f"{what}: logits")
    for name in want_grads:
        assert_close(want_grads[name], have_grads[name], f"{what}: gradient of {name}")
    for step, ((_, want_loss, _), (_, have_loss, _)) in enumerate(zip(*runs)):
        assert_close(want_loss, have_loss, f"{what}: loss at step {step}")
    want, have = trainable(reference), trainable(model)
    assert any("lora_magnitude_vector" in name for name in want)
    for name in want:
        # AdamW's first steps are sign-like: they enlarge the gradients' last-bit differences.
        assert_close(want[name], have[name], f"{what}: {name} after 3 steps", tolerance=1e-4)


def test_saved_adapter_loads_in_plain_peft(dora_served, tmp_path):
    architecture, checkpoint, executor = dora_served
    model, client = virtual_model(checkpoint, executor)
    model = dora(model)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = tokens()
    model(ids, labels=ids).loss.backward()
    client.settle()
    optimizer.step()  # the magnitudes and adapters leave where they started
    model.eval()
    model.save_pretrained(str(tmp_path))
    loaded = peft.PeftModel.from_pretrained(reference_model(checkpoint), str(tmp_path)).eval()
    saved, read = peft.get_peft_model_state_dict(model), peft.get_peft_model_state_dict(loaded)
    assert saved.keys() == read.keys() and any("lora_magnitude_vector" in name for name in saved)
    for name in saved:
        assert torch.equal(saved[name], read[name]), f"{architecture} {name} changed on the way"
    ids = tokens(seed=5)
    with torch.no_grad():
        assert_close(loaded(ids).logits, model(ids).logits, f"{architecture} logits of the loaded adapter")
