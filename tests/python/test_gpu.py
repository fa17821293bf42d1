"""Python tenants on a GPU: a tenant on the executor's GPU (cuda-ipc) and, where a second GPU exists,
one on that GPU (nccl) compute what the same transformers (+ PEFT) model computes in one process on
the tenant's GPU: logits, loss and every LoRA gradient (fp32 within 1e-5, bf16 within 5e-2, the
tolerances of cuda_ipc_test and nccl_test), a few AdamW steps' adapters, and generate()'s tokens.
The executor serves on cuda:0. Skipped, saying so, on a machine without a GPU (the CPU suite covers
the rest); scripts/gpu_check.sh's stage `python` runs it on the GPU machine, under MPS."""
import contextlib
import tempfile

import peft
import pytest
import torch

import symbiosis
from conftest import Executor, assert_close, lora, make_checkpoint, reference_model, tokens, trainable

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(GPUS == 0, reason="no GPU here: the Python GPU tests need one (cuda-ipc), two for nccl")

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 5e-2}
DTYPE_FLAG = {torch.float32: "fp32", torch.bfloat16: "bf16"}


@contextlib.contextmanager
def gpu_served(architecture, dtype):
    """(checkpoint, executor) for a tiny random model of `architecture` served on cuda:0 in `dtype`."""
    with tempfile.TemporaryDirectory(prefix=f"symbiosis-py-gpu-{architecture}-") as checkpoint:
        make_checkpoint(architecture, checkpoint)
        executor = Executor(checkpoint, ["--dtype", DTYPE_FLAG[dtype]], device="cuda:0")
        try:
            yield checkpoint, executor
        finally:
            executor.stop()


def models(checkpoint, executor, device, dtype, tenant):
    """(reference, virtualized, client): the same model with the same LoRA, both on `device`."""
    reference = lora(reference_model(checkpoint).to(device=device, dtype=dtype))
    client = symbiosis.Client.connect(executor.endpoint, tenant=tenant, device=device)
    model = symbiosis.from_pretrained(checkpoint, client, dtype=dtype, attn_implementation="eager")
    return reference, lora(model), client


def check_step_and_training(checkpoint, executor, device, dtype, transport, architecture):
    tolerance = TOLERANCE[dtype]
    reference, model, client = models(checkpoint, executor, device, dtype, f"gpu-{architecture}-{transport}")
    assert client.transport == transport, f"device {device} should reach cuda:0's executor over {transport}"
    assert next(model.parameters()).device == torch.device(device)

    ids = tokens().to(device)
    want, got = reference(ids, labels=ids), model(ids, labels=ids)
    assert_close(want.logits, got.logits, f"{architecture} {transport} logits", tolerance)
    assert_close(want.loss, got.loss, f"{architecture} {transport} loss", tolerance)
    want.loss.backward()
    got.loss.backward()
    client.settle()
    expected, have = trainable(reference), trainable(model)
    assert len(expected) > 0 and expected.keys() == have.keys()
    for name, p in expected.items():
        assert have[name].grad is not None, f"{architecture} {name}: no gradient"
        assert_close(p.grad, have[name].grad, f"{architecture} {transport} gradient of {name}", tolerance)

    # A few AdamW steps: the same loss at each step; in fp32 the same adapters at the end (AdamW's
    # first steps are sign-like: they enlarge the gradients' last-bit differences, so the adapters are
    # held to 1e-4, as on the CPU; in bf16 a gradient near 0 may change sign, so only the losses).
    losses = []
    for m in (reference, model):
        m.train()
        optimizer = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
        losses.append([])
        for step in range(3):
            optimizer.zero_grad()
            batch = tokens(seed=10 + step).to(device)
            loss = m(batch, labels=batch).loss
            loss.backward()
            if m is model:
                client.settle()  # every base-layer call has its result before the adapters change
            optimizer.step()
            losses[-1].append(loss.detach())
    for step, (want_loss, have_loss) in enumerate(zip(*losses)):
        assert_close(want_loss, have_loss, f"{architecture} {transport} loss at step {step}", tolerance)
    if dtype == torch.float32:
        want_adapters = peft.get_peft_model_state_dict(reference)
        have_adapters = peft.get_peft_model_state_dict(model)
        for name, p in want_adapters.items():
            assert_close(p, have_adapters[name], f"{architecture} {transport} adapter {name} after 3 steps", 1e-4)

    if dtype == torch.float32:  # bf16's rounding may turn a near tie between two tokens either way
        reference.eval()
        model.eval()
        prompt = tokens(batch=1, length=5, seed=7).to(device)
        settings = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            want_tokens = reference.generate(input_ids=prompt, **settings)
            with client.latency("decode"):
                have_tokens = model.generate(input_ids=prompt, **settings)
        assert want_tokens.tolist() == have_tokens.tolist(), f"{architecture} {transport} generate"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("architecture", ["llama", "gpt2"])  # Linear and transformers' Conv1D
def test_cuda_ipc_tenant_equals_one_process(architecture, dtype):
    with gpu_served(architecture, dtype) as (checkpoint, executor):
        check_step_and_training(checkpoint, executor, "cuda:0", dtype, "cuda-ipc", architecture)


@pytest.mark.skipif(GPUS < 2, reason="one GPU here: a tenant over nccl needs a second GPU beside the executor's")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_nccl_tenant_on_another_gpu_equals_one_process(dtype):
    with gpu_served("llama", dtype) as (checkpoint, executor):
        check_step_and_training(checkpoint, executor, "cuda:1", dtype, "nccl", "llama")


def test_cuda_ipc_and_nccl_tenants_share_one_executor():
    """A tenant on cuda:0 and, with two GPUs, one on cuda:1 call one executor in turn, each exact."""
    with gpu_served("llama", torch.float32) as (checkpoint, executor):
        devices = ["cuda:0"] + (["cuda:1"] if GPUS >= 2 else [])
        tenants = [models(checkpoint, executor, device, torch.float32, f"shared-{device}") for device in devices]
        for step in range(2):
            for device, (reference, model, client) in zip(devices, tenants):
                ids = tokens(seed=20 + step).to(device)
                want, got = reference(ids, labels=ids), model(ids, labels=ids)
                assert_close(want.logits, got.logits, f"{device} ({client.transport}) logits, step {step}")
                want.loss.backward()
                got.loss.backward()
                client.settle()
                for name, p in trainable(reference).items():
                    assert_close(p.grad, trainable(model)[name].grad, f"{device} gradient of {name}, step {step}")
                reference.zero_grad()
                model.zero_grad()


def test_serving_engine_batches_the_base_and_two_adapters_on_a_gpu(tmp_path):
    """symbiosis-serve's engine ([Serving engine], python/symbiosis/serve/engine.py) on cuda:0 over
    cuda-ipc, its decode steps captured ([Captured decode]) with the rows' adapters in one grouped
    kernel ([Multi-adapter batches]): the base's and two adapters' greedy streams at once, twice
    (the second time from captured graphs), each equal to transformers + PEFT generate on the GPU
    (fp32). The HTTP layer above it is the CPU suite's (test_serve.py)."""
    import asyncio

    from conftest import add_tokenizer, greedy_generate, save_lora
    from symbiosis.serve import Engine, SamplingParams

    with gpu_served("llama", torch.float32) as (checkpoint, executor):
        add_tokenizer(checkpoint)
        adapters = {"alice": save_lora(checkpoint, tmp_path / "alice", seed=3, r=4, lora_alpha=8,
                                       target_modules=["q_proj", "v_proj"]),
                    "bob": save_lora(checkpoint, tmp_path / "bob", seed=4, r=8, lora_alpha=16,
                                     target_modules="all-linear")}
        references = {"": reference_model(checkpoint).to("cuda:0")}
        for name, path in adapters.items():
            references[name] = peft.PeftModel.from_pretrained(reference_model(checkpoint), path).to("cuda:0").eval()
        client = symbiosis.Client.connect(executor.endpoint, tenant="serve", device="cuda:0", latency_class="decode")
        assert client.transport == "cuda-ipc"
        engine = Engine(checkpoint, client, device="cuda:0", dtype="fp32", max_sequences=8, max_tokens=48)
        for name, path in adapters.items():
            engine.load_adapter(name, path)
        prompts = [[1, 17, 45, 99, 3], [1, 120, 5, 66, 70, 71, 33]]
        requests = [(adapter, prompt) for adapter in references for prompt in prompts]

        async def generate_all():
            async def tokens_of(adapter, prompt):
                params = SamplingParams(max_new_tokens=12, stop_token_ids=[2], logprobs=True)
                return [e.token async for e in engine.stream(prompt, params, adapter).events if e.token >= 0]
            return await asyncio.gather(*(tokens_of(adapter, prompt) for adapter, prompt in requests))

        try:
            for _ in range(2):
                for (adapter, prompt), produced in zip(requests, asyncio.run(generate_all())):
                    want, _ = greedy_generate(references[adapter], prompt, 12)
                    assert produced == want, f"adapter '{adapter}', prompt {prompt}"
        finally:
            engine.shutdown()


def test_tinker_service_trains_and_samples_on_a_gpu(tmp_path):
    """symbiosis-tinker (docs/tinker.md) with its runs and sampler on cuda:0, through the tinker SDK:
    two supervised steps equal transformers + PEFT in one process on the GPU (fp32), and the saved
    sampler weights' greedy samples, from the serving Engine's captured steps, equal PEFT's greedy
    generate from the same files."""
    import os

    types = pytest.importorskip("tinker.types", reason="no tinker SDK here: install the wheels of .whl first "
                                                       "(../.library/device/README.md)")
    from conftest import TinkerServer, add_tokenizer, greedy_generate
    from test_tinker import BASE, SEQUENCES, reference_steps, train_steps

    os.environ["TINKER_TELEMETRY"] = "0"
    with gpu_served("llama", torch.float32) as (checkpoint, executor):
        add_tokenizer(checkpoint)
        server = TinkerServer(["--executor", executor.endpoint, "--base-model", f"{BASE}={checkpoint}", "--device",
                               "cuda:0", "--dtype", "fp32", "--state-dir", str(tmp_path / "state")],
                              tmp_path / "tinker.log")
        try:
            training = server.service().create_lora_training_client(base_model=BASE, rank=4, seed=3,
                                                                    train_unembed=False).result()
            ours_logprobs, ours_losses = train_steps(training, 2)
            their_logprobs, their_losses = reference_steps(checkpoint, rank=4, seed=3, steps=2)
            for step in range(2):
                for ours, theirs in zip(ours_logprobs[step], their_logprobs[step]):
                    assert_close(torch.tensor(theirs), torch.tensor(ours), f"step {step} logprobs", 1e-4)
                assert abs(ours_losses[step] - their_losses[step]) <= 1e-4 * abs(their_losses[step])
            saved = training.save_weights_for_sampler("gpu").result()
            sampler = server.service().create_sampling_client(model_path=saved.path)
            prompt = SEQUENCES[0][:4]
            got = sampler.sample(types.ModelInput.from_ints(prompt), 2,
                                 types.SamplingParams(max_tokens=8, temperature=0.0)).result()
            folder = os.path.join(tmp_path, "state", "runs", training.model_id, "sampler_weights", "gpu")
            adapter = peft.PeftModel.from_pretrained(reference_model(checkpoint), folder).to("cuda:0").eval()
            want, _ = greedy_generate(adapter, prompt, 8)  # both end at the tiny model's EOS
            assert [s.tokens for s in got.sequences] == [want, want]
        finally:
            server.stop()
