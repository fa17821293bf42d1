"""symbiosis-tinker's training run (python/symbiosis/tinker/worker.py) and its losses (losses.py): a
run split over an executor trains as transformers + PEFT + AdamW do in one process (per-token
log-probabilities and loss:sum within 1e-5 over three steps); each loss equals its formula; a
save -> load round trip continues as if uninterrupted; bad requests are refused naming the field and
leave the run training; the run's process answers over a Pipe ([Training run protocol])."""
import contextlib
import json
import multiprocessing
import os

import numpy as np
import peft
import pytest
import torch

from conftest import VOCAB, assert_close, reference_model, served
from symbiosis.tinker import losses
from symbiosis.tinker.worker import LORA_ALPHA, TrainingRun, serve

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
RUN = dict(rank=4, seed=7, train_mlp=True, train_attn=True, train_unembed=True)
ADAM = dict(learning_rate=1e-2, beta1=0.85, beta2=0.97, eps=1e-8, weight_decay=0.01, grad_clip_norm=1.0)


@pytest.fixture(scope="module")
def llama():
    """(checkpoint, executor endpoint) of a tiny random Llama, for the whole module."""
    with served("llama") as (checkpoint, executor):
        yield checkpoint, executor.endpoint


def sequence(step, row, length):
    generator = torch.Generator().manual_seed(1000 * step + row)
    return torch.randint(3, VOCAB, (length,), generator=generator).tolist()


def cross_entropy_batch(step):
    """Two datums of different lengths, Tinker style (target_tokens[t] is the token after
    model_input[t]), their weights with zeros (a prompt) and a negative one."""
    datums = []
    for row, length in enumerate((9, 6)):
        tokens = sequence(step, row, length + 1)
        weights = np.ones(length, dtype=np.float32)
        weights[:2] = 0.0
        weights[-1] = -0.5 if row == 0 else 2.0
        datums.append((tokens[:-1], {"target_tokens": np.array(tokens[1:], dtype=np.int64), "weights": weights}))
    return datums


class Reference:
    """What a TrainingRun should compute, in one process: transformers + PEFT (the same seed and
    LoRA config), each datum run alone (no padding), the loss written out, torch's AdamW."""

    def __init__(self, checkpoint):
        torch.manual_seed(RUN["seed"])
        config = peft.LoraConfig(r=RUN["rank"], lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=TARGETS)
        self.model = peft.get_peft_model(reference_model(checkpoint), config)
        self.parameters = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.parameters, lr=ADAM["learning_rate"],
                                           betas=(ADAM["beta1"], ADAM["beta2"]), eps=ADAM["eps"],
                                           weight_decay=ADAM["weight_decay"])

    def forward_backward(self, datums):
        outputs, total = [], 0.0
        for model_input, inputs in datums:
            logits = self.model(input_ids=torch.tensor([model_input])).logits[0]
            logprobs = torch.log_softmax(logits.float(), -1)[torch.arange(len(model_input)),
                                                              torch.from_numpy(inputs["target_tokens"])]
            loss = -(logprobs * torch.from_numpy(inputs["weights"])).sum()
            loss.backward()
            outputs.append(logprobs.detach())
            total += loss.item()
        return outputs, total

    def optim_step(self):
        torch.nn.utils.clip_grad_norm_(self.parameters, ADAM["grad_clip_norm"])
        self.optimizer.step()
        self.optimizer.zero_grad()


def test_split_run_trains_as_transformers_peft_and_adamw_in_one_process(llama):
    checkpoint, endpoint = llama
    run = TrainingRun(checkpoint, endpoint, tenant="tinker-exact", **RUN)
    assert run.client is not None and run.info()["vocab_size"] == VOCAB
    reference = Reference(checkpoint)
    first = None
    for step in range(3):
        datums = cross_entropy_batch(step)
        got, metrics = run.forward_backward(datums, "cross_entropy", {}, forward_only=False)
        expected, expected_loss = reference.forward_backward(datums)
        assert all(key.count(":") == 1 for key in metrics), metrics
        for index, (a, b) in enumerate(zip(expected, got)):
            assert b.dtype == np.float32 and b.shape == (len(datums[index][0]),)
            assert_close(a, torch.from_numpy(b), f"step {step}, datum {index}: target logprobs")
        assert abs(metrics["loss:sum"] - expected_loss) <= 1e-5 * abs(expected_loss), (step, metrics, expected_loss)
        optim_metrics = run.optim_step(**ADAM)
        assert optim_metrics["grad_norm:mean"] > 0
        reference.optim_step()
        first = first if first is not None else got
    # The adapter moved: the first batch's log-probabilities are no longer what they were.
    again, _ = run.forward_backward(cross_entropy_batch(0), "cross_entropy", {}, forward_only=True)
    assert np.abs(again[0] - first[0]).max() > 1e-3


def test_each_loss_equals_its_formula():
    generator = torch.Generator().manual_seed(3)
    lengths = (5, 3)
    lp = [-torch.rand(n, generator=generator, dtype=torch.float64) * 3 for n in lengths]
    slp = [x + 0.4 * torch.randn(x.shape, generator=generator, dtype=torch.float64) for x in lp]
    advantages = [torch.randn(n, generator=generator, dtype=torch.float64) for n in lengths]
    weights = [torch.tensor([0.0, 1.0, -2.0, 0.5, 3.0], dtype=torch.float64), torch.tensor([1.0, 0.0, -1.0],
                                                                                           dtype=torch.float64)]
    inputs = [{"target_tokens": torch.arange(n), "weights": w, "logprobs": s, "advantages": a}
              for n, w, s, a in zip(lengths, weights, slp, advantages)]

    def direct(loss_fn, beta=0.05, low=None, high=None, masks=None):
        """The formula written per token in plain Python floats."""
        total = 0.0
        for i in range(len(lengths)):
            # gspo's sequence ratio: the mean log-ratio over the datum's marked tokens (all without a mask).
            marked = [t for t in range(lengths[i]) if masks is None or masks[i][t] != 0]
            sequence_r = np.exp(sum(lp[i][t].item() - slp[i][t].item() for t in marked) / len(marked))
            for t in range(lengths[i]):
                x, s, a, w = lp[i][t].item(), slp[i][t].item(), advantages[i][t].item(), weights[i][t].item()
                r = np.exp(x - s)
                if loss_fn == "cross_entropy":
                    total += -x * w
                elif loss_fn == "importance_sampling":
                    total += -r * a
                elif loss_fn == "ppo":
                    total += -min(r * a, min(max(r, low), high) * a)
                elif loss_fn == "cispo":
                    total += -min(max(r, low), high) * x * a
                elif loss_fn == "dro":
                    total += -(x * a - 0.5 * beta * (x - s) ** 2)
                elif loss_fn == "gspo":
                    total += -min(sequence_r * a, min(max(sequence_r, low), high) * a)
        return total

    cases = [("cross_entropy", {}, direct("cross_entropy")),
             ("importance_sampling", {}, direct("importance_sampling")),
             ("ppo", {}, direct("ppo", low=0.8, high=1.2)),
             ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}, direct("ppo", low=0.9, high=1.05)),
             ("cispo", {}, direct("cispo", low=0.0, high=4.0)),
             ("cispo", {"clip_high_threshold": 1.1}, direct("cispo", low=0.0, high=1.1)),
             ("dro", {"beta": 0.05}, direct("dro", beta=0.05)),
             ("dro", {"beta": 2.0}, direct("dro", beta=2.0)),
             ("gspo", {}, direct("gspo", low=1 - 3e-4, high=1 + 4e-4)),
             ("gspo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, direct("gspo", low=0.8, high=1.2))]
    for loss_fn, config, expected in cases:
        loss, metrics = losses.loss_of(loss_fn, lp, inputs, config)
        assert loss.item() == pytest.approx(expected, rel=1e-12, abs=1e-12), (loss_fn, config)
        assert metrics["loss:sum"] == pytest.approx(expected, rel=1e-12, abs=1e-12)
        assert all(key.count(":") == 1 for key in metrics), metrics

    # cispo stops the gradient through its ratio: d/dlp = -clamp(r)·A, not that plus r's own.
    trained = [x.clone().requires_grad_() for x in lp]
    losses.loss_of("cispo", trained, inputs, {"clip_high_threshold": 1.1})[0].backward()
    for x, s, a, g in zip(lp, slp, advantages, trained):
        assert torch.allclose(g.grad, -torch.exp(x - s).clamp(0.0, 1.1) * a, rtol=1e-12)

    # gspo: every token carries its sequence's ratio s, with its own log-probability's gradient:
    # d/dlp_t = -s·A_t where unclipped, 0 where the clip holds; here no clip (a range that holds none).
    trained = [x.clone().requires_grad_() for x in lp]
    losses.loss_of("gspo", trained, inputs, {"clip_low_threshold": 0.0, "clip_high_threshold": 100.0})[0].backward()
    for x, s, a, g in zip(lp, slp, advantages, trained):
        assert torch.allclose(g.grad, -torch.exp((x - s).mean()) * a, rtol=1e-12)
    # sequence_ratio_mask picks the tokens s averages over.
    masks = [torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0], dtype=torch.float64), torch.tensor([0.0, 1.0, 0.0],
                                                                                        dtype=torch.float64)]
    masked = [dict(d, sequence_ratio_mask=m) for d, m in zip(inputs, masks)]
    assert losses.loss_of("gspo", lp, masked, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})[0].item() \
        == pytest.approx(direct("gspo", low=0.8, high=1.2, masks=masks), rel=1e-12)

    # A clip range per token (loss_fn_inputs) wins over the config's.
    per_token = [dict(d, clip_low_threshold=torch.full((n,), 0.9, dtype=torch.float64),
                      clip_high_threshold=torch.full((n,), 1.05, dtype=torch.float64))
                 for d, n in zip(inputs, lengths)]
    assert losses.loss_of("ppo", lp, per_token, {})[0].item() == pytest.approx(direct("ppo", low=0.9, high=1.05),
                                                                              rel=1e-12)


def test_losses_refuse_bad_requests_naming_the_field():
    lp = [torch.zeros(3)]
    good = {"target_tokens": torch.arange(3), "weights": torch.ones(3), "logprobs": torch.zeros(3),
            "advantages": torch.ones(3)}
    for loss_fn in ("stable_reinforce", "custom", "nonsense"):
        supported = "cross_entropy, importance_sampling, ppo, cispo, dro, gspo"
        with pytest.raises(ValueError, match=f"loss_fn '{loss_fn}' is not supported; supported: {supported}"):
            losses.loss_of(loss_fn, lp, [good], {})
    with pytest.raises(ValueError, match="'beta'"):
        losses.loss_of("dro", lp, [good], {})
    with pytest.raises(ValueError, match="unknown keys clip_ratio, foo"):
        losses.loss_of("ppo", lp, [good], {"foo": 1.0, "clip_ratio": 0.2})
    with pytest.raises(ValueError, match="unknown keys beta"):
        losses.loss_of("cross_entropy", lp, [good], {"beta": 1.0})
    missing = {k: v for k, v in good.items() if k != "advantages"}
    with pytest.raises(ValueError, match="datum 1: loss_fn_inputs has no 'advantages'"):
        losses.loss_of("importance_sampling", lp * 2, [good, missing], {})
    short = dict(good, logprobs=torch.zeros(2))
    with pytest.raises(ValueError, match="datum 0: field 'logprobs' has length 2, expected 3"):
        losses.loss_of("ppo", lp, [short], {})
    with pytest.raises(ValueError, match="datum 0: field 'sequence_ratio_mask' marks no token"):
        losses.loss_of("gspo", lp, [dict(good, sequence_ratio_mask=torch.zeros(3))], {})
    with pytest.raises(ValueError, match="datum 0: field 'sequence_ratio_mask' has length 2, expected 3"):
        losses.loss_of("gspo", lp, [dict(good, sequence_ratio_mask=torch.ones(2))], {})
    with pytest.raises(ValueError, match="datum 0: field 'weights' is nan at position 1"):
        losses.loss_of("cross_entropy", lp, [dict(good, weights=torch.tensor([1.0, float("nan"), 0.0]))], {})


def test_save_then_load_in_a_fresh_run_continues_as_if_uninterrupted(llama, tmp_path):
    checkpoint, endpoint = llama
    run = TrainingRun(checkpoint, endpoint, tenant="tinker-saved", **RUN)
    for step in range(2):
        run.forward_backward(cross_entropy_batch(step), "cross_entropy", {}, forward_only=False)
        run.optim_step(**ADAM)
    folder = str(tmp_path / "state")
    run.save(folder, optimizer=True)
    files = {"adapter_config.json", "adapter_model.safetensors", "optimizer.pt", "tinker.json"}
    assert files <= set(os.listdir(folder))
    with open(os.path.join(folder, "tinker.json")) as f:
        saved = json.load(f)
    assert saved["rank"] == 4 and saved["seed"] == 7 and saved["train_unembed"] is True
    assert saved["base_checkpoint"] == os.path.abspath(checkpoint)

    def continue_training(training_run):
        """Step 3 (a forward_backward and an AdamW step), then step 4's forward: the last shows the
        optimizer's moments, the first only the adapter."""
        third, metrics = training_run.forward_backward(cross_entropy_batch(2), "cross_entropy", {}, forward_only=False)
        training_run.optim_step(**ADAM)
        fourth, _ = training_run.forward_backward(cross_entropy_batch(3), "cross_entropy", {}, forward_only=True)
        return third + fourth, metrics["loss:sum"]

    # The adapter saved is a plain PEFT adapter: PEFT alone gives the run's log-probabilities.
    datums = cross_entropy_batch(2)
    plain = peft.PeftModel.from_pretrained(reference_model(checkpoint), folder)
    with torch.no_grad():
        model_input, inputs = datums[0]
        logits = plain(input_ids=torch.tensor([model_input])).logits[0]
        targets = torch.from_numpy(inputs["target_tokens"])
        expected = torch.log_softmax(logits, -1)[torch.arange(len(model_input)), targets]
    ours, _ = run.forward_backward(datums[:1], "cross_entropy", {}, forward_only=True)
    assert_close(expected, torch.from_numpy(ours[0]), "PEFT's model of the saved adapter")

    uninterrupted, uninterrupted_loss = continue_training(run)
    # Another seed: what it would initialize is overwritten by load.
    resumed_run = TrainingRun(checkpoint, endpoint, tenant="tinker-resumed", **dict(RUN, seed=99))
    resumed_run.load(folder, optimizer=True)
    resumed, resumed_loss = continue_training(resumed_run)
    assert resumed_loss == uninterrupted_loss
    for a, b in zip(uninterrupted, resumed):
        np.testing.assert_array_equal(a, b)

    # Without the optimizer's state, the step after the load is another one.
    weights_only = TrainingRun(checkpoint, endpoint, tenant="tinker-weights-only", **RUN)
    weights_only.load(folder, optimizer=False)
    fresh, fresh_loss = continue_training(weights_only)
    assert fresh_loss == uninterrupted_loss  # step 3's forward sees the same adapter
    assert np.abs(fresh[-1] - uninterrupted[-1]).max() > 1e-6


def test_bad_requests_are_refused_naming_the_field_and_the_run_still_trains(llama, tmp_path):
    checkpoint, endpoint = llama
    with pytest.raises(ValueError, match="rank is 0; expected an integer from 1 to 512"):
        TrainingRun(checkpoint, endpoint, **dict(RUN, rank=0))
    with pytest.raises(ValueError, match="train_mlp, train_attn and train_unembed are all false"):
        TrainingRun(checkpoint, endpoint, **dict(RUN, train_mlp=False, train_attn=False, train_unembed=False))

    run = TrainingRun(checkpoint, endpoint, tenant="tinker-refusals", **RUN)
    datums = cross_entropy_batch(0)
    before, _ = run.forward_backward(datums, "cross_entropy", {}, forward_only=True)
    (tokens, inputs), second = datums

    def refused(batch, loss_fn, config, match):
        with pytest.raises(ValueError, match=match):
            run.forward_backward(batch, loss_fn, config, forward_only=False)
        assert all(p.grad is None for p in run.adapter_parameters), "a refused request left gradients"

    bad_target = dict(inputs, target_tokens=np.array([VOCAB] + list(inputs["target_tokens"][1:]), dtype=np.int64))
    refused([(tokens, bad_target), second], "cross_entropy", {},
            f"datum 0: field 'target_tokens' has token id {VOCAB} at position 0, "
            f"outside the vocabulary \\[0, {VOCAB}\\)")
    refused([second, ([5, VOCAB + 3] + tokens[2:], inputs)], "cross_entropy", {},
            f"datum 1: field 'model_input' has token id {VOCAB + 3} at position 1")
    refused([(tokens, dict(inputs, weights=inputs["weights"][:-1]))], "cross_entropy", {},
            f"datum 0: field 'weights' has length {len(tokens) - 1}, expected {len(tokens)}")
    refused([(tokens[:-1], inputs)], "cross_entropy", {},
            f"datum 0: field 'target_tokens' has length {len(tokens)}, expected {len(tokens) - 1}")
    refused(datums, "stable_reinforce", {}, "loss_fn 'stable_reinforce' is not supported; supported: cross_entropy")
    rl_inputs = {"target_tokens": inputs["target_tokens"], "logprobs": np.zeros(len(tokens), np.float32),
                 "advantages": np.ones(len(tokens), np.float32)}
    refused([(tokens, rl_inputs)], "dro", {}, "needs 'beta'")
    refused([], "cross_entropy", {}, "no datums")
    with pytest.raises(ValueError, match="beta1 is 1.5; expected 0 <= beta1 < 1"):
        run.optim_step(**dict(ADAM, beta1=1.5))
    run.save(str(tmp_path / "weights"), optimizer=False)
    with pytest.raises(ValueError, match="weights holds no optimizer state"):
        run.load(str(tmp_path / "weights"), optimizer=True)
    other_rank = TrainingRun(checkpoint, None, **dict(RUN, rank=2))
    other_rank.save(str(tmp_path / "rank2"), optimizer=True)
    with pytest.raises(ValueError, match="field 'r' is 2, expected 4"):
        run.load(str(tmp_path / "rank2"), optimizer=True)

    # Nothing refused changed the run: the same log-probabilities, and it trains.
    after, _ = run.forward_backward(datums, "cross_entropy", {}, forward_only=True)
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)
    _, first = run.forward_backward(datums, "cross_entropy", {}, forward_only=False)
    run.optim_step(**ADAM)
    run.forward_backward(datums, "cross_entropy", {}, forward_only=False)
    run.optim_step(**ADAM)
    _, trained = run.forward_backward(datums, "cross_entropy", {}, forward_only=True)
    assert trained["loss:sum"] < first["loss:sum"]
    rl, metrics = run.forward_backward([(tokens, rl_inputs)], "dro", {"beta": 0.1}, forward_only=False)
    assert np.isfinite(metrics["loss:sum"]) and rl[0].shape == (len(tokens),)


@contextlib.contextmanager
def served_run(settings):
    """(our end of the Pipe, the process) of worker.serve(**settings) in a spawned process, killed
    after if it is still there."""
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    process = context.Process(target=serve, args=(theirs,), kwargs=settings, daemon=True)
    process.start()
    theirs.close()
    try:
        yield ours, process
    finally:
        if process.is_alive():
            process.kill()
            process.join()


def test_serve_answers_over_a_pipe_in_a_process_of_its_own(llama):
    checkpoint, endpoint = llama
    with served_run(dict(checkpoint=checkpoint, executor=endpoint, tenant="tinker-served", **RUN)) as (ours, process):
        assert ours.poll(120), "the run's process did not report"
        status, info = ours.recv()
        assert status == "ready", info
        assert info["vocab_size"] == VOCAB and info["lora_rank"] == 4 and info["model_type"] == "llama"

        datums = cross_entropy_batch(0)
        ours.send(("forward_backward", (datums, "cross_entropy", {}, False), {}))
        status, (outputs, metrics) = ours.recv()
        assert status == "ok"
        expected, expected_metrics = TrainingRun(checkpoint, None, **RUN).forward_backward(
            datums, "cross_entropy", {}, forward_only=False)
        for a, b in zip(expected, outputs):
            assert_close(torch.from_numpy(a), torch.from_numpy(b), "served target logprobs")
        assert metrics["loss:sum"] == pytest.approx(expected_metrics["loss:sum"], rel=1e-5)

        bad = [(datums[0][0], dict(datums[0][1], weights=np.ones(2, np.float32)))]
        ours.send(("forward_backward", (bad, "cross_entropy", {}, False), {}))
        status, kind, message = ours.recv()
        assert (status, kind) == ("error", "user") and "field 'weights' has length 2" in message
        ours.send(("no_such_method", (), {}))
        assert ours.recv()[:2] == ("error", "server")
        ours.send(("optim_step", (), ADAM))
        status, optim_metrics = ours.recv()
        assert status == "ok" and optim_metrics["grad_norm:mean"] > 0
        ours.send(None)
        process.join(60)
        assert process.exitcode == 0

    # A run that cannot be built says why, as the client's error, and its process ends.
    with served_run(dict(checkpoint=checkpoint, executor=None, **dict(RUN, rank=0))) as (ours, process):
        assert ours.poll(120)
        status, kind, message = ours.recv()
        assert (status, kind) == ("error", "user") and "rank is 0" in message
        process.join(60)
        assert process.exitcode == 0
