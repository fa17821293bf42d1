"""symbiosis-tinker (python/symbiosis/tinker/, docs/tinker.md) through the official `tinker` SDK,
unmodified: one server for the module over a tiny Llama split over an executor, keys of two owners.
A supervised loop's per-token logprobs and losses equal the same steps in one process with
transformers + PEFT; an RL loop (sample a group, score it, importance_sampling, optim_step) raises
its reward; runs of two keys are isolated; a run's worker killed leaves another training; save and
load with the optimizer resume with identical losses; bad input is refused naming the field and
the run goes on."""
import json
import os
import re
import signal
import time
import urllib.error
import urllib.request

import numpy as np
import peft
import pytest
import tinker
import torch
from tinker import types

import symbiosis
from conftest import VOCAB, TinkerServer, add_tokenizer, reference_model, served
from symbiosis.tinker import worker

BASE = "tiny/llama"
ALICE, BOB = TinkerServer.KEY, "tml-bob-key"
ADAM = dict(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    os.environ["TINKER_TELEMETRY"] = "0"
    work = tmp_path_factory.mktemp("tinker")
    with served("llama") as (checkpoint, executor):
        add_tokenizer(checkpoint)
        keys = work / "keys.json"
        keys.write_text(json.dumps({ALICE: "alice", BOB: "bob"}))
        running = TinkerServer(["--executor", executor.endpoint, "--base-model", f"{BASE}={checkpoint}", "--api-keys",
                          str(keys), "--state-dir", str(work / "state"), "--max-lora-rank", "64"],
                         work / "tinker.log")
        running.checkpoint = checkpoint
        running.executor = executor.endpoint
        running.work = work
        try:
            yield running
        finally:
            running.stop()


def new_run(server, key=ALICE, rank=4, seed=3, **lora):
    """A TrainingClient of a new run of the base (no unembedding adapter unless asked)."""
    lora.setdefault("train_unembed", False)
    return server.service(key).create_lora_training_client(base_model=BASE, rank=rank, seed=seed, **lora).result()


def datum(tokens, **inputs):
    """A datum predicting tokens[1:] from tokens[:-1]; inputs: its other loss_fn_inputs."""
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], **inputs})


SEQUENCES = [[1, 17, 45, 99, 3, 8, 21], [1, 120, 5, 66]]
WEIGHTS = [[1.0, 1.0, 0.0, 1.0, 0.5, 1.0], [1.0, -0.5, 1.0]]


def supervised_data():
    return [datum(s, weights=w) for s, w in zip(SEQUENCES, WEIGHTS)]


def reference_steps(checkpoint, rank, seed, steps):
    """(per-step per-datum logprobs, per-step loss) of the same loop with transformers + PEFT in one
    process: the adapter and AdamW as worker.py makes them ([Tinker training semantics])."""
    model = reference_model(checkpoint)
    attention, mlp, _ = worker.TARGET_MODULES["llama"]
    torch.manual_seed(seed)
    model = peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=worker.LORA_ALPHA, lora_dropout=0.0,
                                                       target_modules=list(attention) + list(mlp)))
    model.eval()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=ADAM["learning_rate"],
                                  betas=(ADAM["beta1"], ADAM["beta2"]), eps=ADAM["eps"], weight_decay=0.0)
    logprobs, losses = [], []
    for _ in range(steps):
        step_logprobs, loss = [], 0.0
        for tokens, weights in zip(SEQUENCES, WEIGHTS):
            ids = torch.tensor([tokens[:-1]])
            lp = model(input_ids=ids).logits.float().log_softmax(-1)[0].gather(-1, torch.tensor(tokens[1:])[:, None])
            lp = lp[:, 0]
            loss = loss - (lp * torch.tensor(weights)).sum()
            step_logprobs.append(lp.detach().numpy())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        logprobs.append(step_logprobs)
        losses.append(loss.item())
    return logprobs, losses


def train_steps(training, steps):
    logprobs, losses = [], []
    for _ in range(steps):
        result = training.forward_backward(supervised_data(), "cross_entropy")
        optim = training.optim_step(types.AdamParams(**ADAM))
        result = result.result()
        optim.result()
        logprobs.append([o["logprobs"].to_numpy() for o in result.loss_fn_outputs])
        losses.append(result.metrics["loss:sum"])
    return logprobs, losses


def test_capabilities_and_info_name_the_served_model(server):
    capabilities = server.service().get_server_capabilities()
    assert [m.model_name for m in capabilities.supported_models] == [BASE]
    training = new_run(server)
    info = training.get_info()
    assert info.model_data.model_name == BASE and info.lora_rank == 4
    assert training.get_tokenizer().encode("hello", add_special_tokens=False)  # the checkpoint's, offline


def test_supervised_steps_equal_transformers_peft_in_one_process(server):
    training = new_run(server)
    ours_logprobs, ours_losses = train_steps(training, 3)
    their_logprobs, their_losses = reference_steps(server.checkpoint, rank=4, seed=3, steps=3)
    for step in range(3):
        for ours, theirs in zip(ours_logprobs[step], their_logprobs[step]):
            np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5, err_msg=f"step {step}")
        assert ours_losses[step] == pytest.approx(their_losses[step], rel=1e-5)
    assert ours_losses[2] < ours_losses[0]  # it trains


def test_forward_backward_custom_and_forward_only(server):
    training = new_run(server)
    before = training.forward(supervised_data(), "cross_entropy").result()
    again = training.forward(supervised_data(), "cross_entropy").result()  # forward keeps no gradient
    assert before.metrics["loss:sum"] == again.metrics["loss:sum"]
    custom = training.forward_backward_custom(
        supervised_data(), lambda data, logprobs: (sum((lp ** 2).sum() for lp in logprobs), {})).result()
    expected = sum(float((o["logprobs"].to_numpy() ** 2).sum()) for o in before.loss_fn_outputs)
    assert custom.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)


def test_rl_loop_raises_its_reward(server):
    """Sample a group, reward each sampled token in the vocabulary's lower half, importance_sampling,
    optim_step: the reward (such tokens of 6) climbs from about half by more than one token."""
    prompt = [1, 17, 45]
    training = new_run(server, rank=8, seed=5, train_unembed=True)
    rewards = []
    for step in range(10):
        sampler = training.save_weights_and_get_sampling_client()
        group = sampler.sample(types.ModelInput.from_ints(prompt), 8,
                               types.SamplingParams(max_tokens=6, temperature=1.0, seed=100 + step, stop=[])).result()
        data, reward = [], []
        for sequence in group.sequences:
            assert len(sequence.logprobs) == len(sequence.tokens) == 6
            hits = [float(t < VOCAB // 2) for t in sequence.tokens]
            reward.append(sum(hits))
            tokens = prompt + sequence.tokens
            n = len(prompt) - 1
            data.append(datum(tokens, logprobs=[0.0] * n + sequence.logprobs,
                              advantages=[0.0] * n + [h - 0.5 for h in hits]))
        rewards.append(np.mean(reward))
        training.forward_backward(data, "importance_sampling").result()
        training.optim_step(types.AdamParams(learning_rate=0.05)).result()
    assert np.mean(rewards[-2:]) > np.mean(rewards[:2]) + 1.0, rewards


def test_compute_logprobs_are_the_trained_models(server):
    training = new_run(server)
    train_steps(training, 1)
    forward = training.forward([datum(SEQUENCES[0], weights=[0.0] * 6)], "cross_entropy").result()
    sampler = training.save_weights_and_get_sampling_client()
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(SEQUENCES[0])).result()
    assert scored[0] is None
    np.testing.assert_allclose(scored[1:], forward.loss_fn_outputs[0]["logprobs"].to_numpy(), rtol=1e-5, atol=1e-5)


def test_save_and_load_with_optimizer_resume_with_identical_losses(server):
    service = server.service()
    straight = new_run(server, seed=9)
    _, straight_losses = train_steps(straight, 4)
    first = new_run(server, seed=9)
    _, first_losses = train_steps(first, 2)
    saved = first.save_state("two-steps").result()
    resumed = service.create_training_client_from_state_with_optimizer(saved.path)
    if hasattr(resumed, "result"):
        resumed = resumed.result()
    _, resumed_losses = train_steps(resumed, 2)
    assert first_losses + resumed_losses == pytest.approx(straight_losses, rel=1e-6)
    # The checkpoint is listed, and downloads as a PEFT adapter.
    assert saved.path in [c.tinker_path for c in server.rest().list_checkpoints(first.model_id).result().checkpoints]


def test_a_checkpoint_downloads_as_a_peft_adapter(server, tmp_path):
    training = new_run(server)
    train_steps(training, 1)
    saved = training.save_weights_for_sampler("for-download").result()
    run_id, _, rest_of = saved.path[len("tinker://"):].partition("/")
    listing = json.load(urllib.request.urlopen(urllib.request.Request(
        f"{server.url}/api/v1/training_runs/{run_id}/checkpoints/{rest_of}/external_weights_urls",
        headers={"X-API-Key": ALICE})))
    for name, url in listing["urls"].items():
        (tmp_path / name).write_bytes(urllib.request.urlopen(url).read())
    adapter = peft.PeftModel.from_pretrained(reference_model(server.checkpoint), str(tmp_path))
    forward = training.forward([datum(SEQUENCES[0], weights=[0.0] * 6)], "cross_entropy").result()
    lp = adapter(input_ids=torch.tensor([SEQUENCES[0][:-1]])).logits.float().log_softmax(-1)[0]
    expected = lp.gather(-1, torch.tensor(SEQUENCES[0][1:])[:, None])[:, 0].detach().numpy()
    np.testing.assert_allclose(forward.loss_fn_outputs[0]["logprobs"].to_numpy(), expected, rtol=1e-5, atol=1e-5)


def test_sampler_weights_are_handed_over_in_memory(server, tmp_path):
    """[Sampler hand-over] (python/symbiosis/tinker/app.py): a run's save for the sampler hands over
    what it wrote, tensor for tensor, and the sampler's engine loads that with the folder gone."""
    import safetensors.torch
    from symbiosis.serve.engine import Engine

    run = worker.TrainingRun(server.checkpoint, None, rank=4, seed=3, train_mlp=True, train_attn=True,
                             train_unembed=False)
    folder = tmp_path / "saved"
    contents = run.save(str(folder), False, hand_over=True)
    assert json.loads(contents["config_json"]) == json.loads((folder / "adapter_config.json").read_text())
    written = safetensors.torch.load_file(str(folder / "adapter_model.safetensors"))
    assert sorted(contents["tensors"]) == sorted(written)
    for name, tensor in written.items():
        assert torch.equal(contents["tensors"][name], tensor), name
    assert run.save(str(tmp_path / "plain"), False) is None
    run.close()
    engine = Engine(server.checkpoint, None, max_loras=2, max_lora_rank=8)
    for path in folder.iterdir():
        path.unlink()
    folder.rmdir()
    engine.load_adapter_contents("handed", str(folder), contents["config_json"], contents["tensors"])
    assert engine.adapters == ["handed"]
    broken = dict(contents["tensors"])
    broken.pop(next(iter(broken)))
    with pytest.raises(symbiosis.Error, match=re.escape(f"{folder}/adapter_model.safetensors") + '" holds'):
        engine.load_adapter_contents("broken", str(folder), contents["config_json"], broken)
    engine.shutdown()


def test_two_keys_runs_are_isolated(server):
    alice = new_run(server, seed=1)
    saved = alice.save_weights_for_sampler("alices").result()
    bob_rest = server.rest(BOB)
    assert alice.model_id not in [r.training_run_id for r in bob_rest.list_training_runs().result().training_runs]
    with pytest.raises(tinker.NotFoundError):
        bob_rest.get_training_run(alice.model_id).result()
    with pytest.raises(Exception, match="no checkpoint"):
        server.service(BOB).create_sampling_client(model_path=saved.path).sample(
            types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=2)).result()
    with pytest.raises(tinker.AuthenticationError):
        tinker.RestClient(base_url=server.url, api_key="tml-nobody").list_training_runs().result()


def test_a_killed_runs_worker_leaves_another_training(server):
    before = server.workers()
    doomed = new_run(server, seed=2)
    doomed_worker = server.workers() - before
    other = new_run(server, seed=2)
    assert len(doomed_worker) == 1
    os.kill(doomed_worker.pop(), signal.SIGKILL)
    with pytest.raises(Exception, match="worker process of run .* has ended"):
        train_steps(doomed, 1)
    _, losses = train_steps(other, 2)
    assert losses[1] < losses[0]


@pytest.mark.parametrize("bad, expected", [
    (lambda t: t.forward_backward([datum([1, 5, 999], weights=[1.0, 1.0])], "cross_entropy"), "999"),
    (lambda t: t.forward_backward([types.Datum(model_input=types.ModelInput.from_ints([1, 5, 6]), loss_fn_inputs={
        "target_tokens": [5, 6, 7], "weights": [1.0, 1.0]})], "cross_entropy"), "weights"),
    (lambda t: t.forward_backward(supervised_data(), "gspo"), "gspo"),
    (lambda t: t.forward_backward([datum([1, 5, 6], logprobs=[0.0, 0.0], advantages=[1.0])], "importance_sampling"),
     "advantages"),
])
def test_bad_training_input_is_refused_naming_the_field_and_the_run_goes_on(server, bad, expected):
    training = new_run(server)
    with pytest.raises(Exception, match=expected):
        bad(training).result()
    _, losses = train_steps(training, 1)
    assert np.isfinite(losses[0])


def test_bad_sampling_input_is_refused_naming_the_field(server):
    sampler = new_run(server).save_weights_and_get_sampling_client()
    with pytest.raises(Exception, match=r"tokens\[1\] is 999, expected a token id in \[0, 128\)"):
        sampler.sample(types.ModelInput.from_ints([1, 999]), 1, types.SamplingParams(max_tokens=2)).result()
    with pytest.raises(Exception, match="topk_prompt_logprobs: this server does not compute it"):
        sampler.sample(types.ModelInput.from_ints([1, 5]), 1, types.SamplingParams(max_tokens=2),
                       include_prompt_logprobs=True, topk_prompt_logprobs=2).result()
    # The sampler goes on.
    assert len(sampler.sample(types.ModelInput.from_ints([1, 5]), 2,
                              types.SamplingParams(max_tokens=2, stop=[])).result().sequences) == 2


def test_unknown_base_model_and_bad_rank_are_refused_naming_them(server):
    with pytest.raises(Exception, match="base_model 'nope' is not served here"):
        server.service().create_lora_training_client(base_model="nope", rank=4).result()
    with pytest.raises(Exception, match="rank is 0, expected 1 to 64"):
        server.service().create_lora_training_client(base_model=BASE, rank=0).result()


def test_an_endpoint_not_implemented_is_named(server):
    request = urllib.request.Request(f"{server.url}/api/v1/create_custom_loss", data=b"{}", method="POST",
                                     headers={"X-API-Key": ALICE, "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 404
    assert "does not implement POST /api/v1/create_custom_loss" in refused.value.read().decode()


def test_a_silent_session_ends_its_runs_workers(server):
    """[Session expiry]: a client that stops heartbeating (here: a session made by hand, which never
    heartbeats) loses its runs' workers after --session-timeout-s; the runs stay listed. The timeout
    is long enough that the run's worker is there to see before it ends, on a loaded 2-core machine
    too (with 2 s, creating the run there once took longer than the session lived)."""
    quick = TinkerServer(["--executor", server.executor, "--base-model", f"{BASE}={server.checkpoint}",
                          "--state-dir", str(server.work / "quick"), "--session-timeout-s", "10"],
                         server.work / "quick.log")
    try:
        def post(path, body):
            request = urllib.request.Request(f"{quick.url}/api/v1/{path}", data=json.dumps(body).encode(),
                                             method="POST", headers={"X-API-Key": ALICE,
                                                                     "Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as response:
                return json.load(response)

        session = post("create_session", {})["session_id"]
        created = post("create_model", {"session_id": session, "model_seq_id": 0, "base_model": BASE,
                                        "lora_config": {"rank": 4, "train_unembed": False}})
        assert post("retrieve_future", {"request_id": created["request_id"]})["model_id"] == created["model_id"]
        assert len(quick.workers()) == 1
        deadline = time.monotonic() + 60  # a bound on waiting, not a measure
        while quick.workers() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not quick.workers()
        with pytest.raises(urllib.error.HTTPError) as ended:
            post("session_heartbeat", {"session_id": session})
        assert ended.value.code == 410
        assert quick.rest().get_training_run(created["model_id"]).result().training_run_id == created["model_id"]
    finally:
        quick.stop()
