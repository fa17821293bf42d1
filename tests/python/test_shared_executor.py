"""A Python tenant and a C++ tenant share one executor at the same time, each exact: the C++ demo
client checks its own fine-tuning against the same steps run in one process (--verify), and the
Python tenant's LoRA training equals transformers + PEFT run in one process."""
import subprocess
import tempfile

import peft
import torch

import symbiosis
from conftest import DEMO_CLIENT, MAKE_CHECKPOINT, Executor, assert_close, reference_model, tokens


def lora(model):
    torch.manual_seed(1)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"],
                                                      init_lora_weights=False))


def train(model, client, steps, until=None):
    """AdamW steps of LoRA fine-tuning: `steps` of them, or at least `steps` and then on until
    until() is true (at most 200)."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    losses = []
    step = 0
    while step < steps or (until is not None and not until() and step < 200):
        ids = tokens(batch=2, length=16, seed=step)
        loss = model(ids, labels=ids).loss
        loss.backward()
        if client is not None:
            client.settle()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
        step += 1
    return losses


def test_python_and_cpp_tenants_share_one_executor():
    with tempfile.TemporaryDirectory(prefix="symbiosis-py-shared-") as checkpoint:
        # The C++ tenant builds its model from the checkpoint: one of the presets it knows.
        subprocess.run([MAKE_CHECKPOINT, "--preset", "tiny-llama", "--out", checkpoint], check=True,
                       stdout=subprocess.DEVNULL)
        executor = Executor(checkpoint)
        try:
            client = symbiosis.Client.connect(executor.endpoint, tenant="python-tenant")
            model = lora(symbiosis.from_pretrained(checkpoint, client, attn_implementation="eager"))
            model.train()
            cpp_tenant = subprocess.Popen(
                [DEMO_CLIENT, "--executor", executor.endpoint, "--model", checkpoint, "--tenant", "cpp-tenant",
                 "--steps", "20", "--seq", "16", "--verify", "--quiet"],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            # The Python tenant trains for as long as the C++ tenant runs: the two overlap throughout.
            got = train(model, client, steps=3, until=lambda: cpp_tenant.poll() is not None)
            cpp_output, _ = cpp_tenant.communicate(timeout=600)
            log = executor.log()
        finally:
            executor.stop()
        assert cpp_tenant.returncode == 0, f"C++ tenant failed:\n{cpp_output}\nexecutor log:\n{log}"
        assert "EXACT" in cpp_output, cpp_output
        assert "tenant 'python-tenant'" in log and "tenant 'cpp-tenant'" in log, log

        reference = lora(reference_model(checkpoint))
        reference.train()
        want = train(reference, None, steps=len(got))
        for step, (a, b) in enumerate(zip(want, got)):
            assert_close(a, b, f"Python tenant's loss at step {step}")
        want_adapter = peft.get_peft_model_state_dict(reference)
        have_adapter = peft.get_peft_model_state_dict(model)
        for name in want_adapter:
            assert_close(want_adapter[name], have_adapter[name], f"Python tenant's adapter {name}", tolerance=1e-4)
