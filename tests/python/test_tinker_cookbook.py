"""tinker-cookbook (PyPI, 0.5.8) against symbiosis-tinker: its supervised recipe (sl_basic's, on
the cookbook's own example conversations) and its rl_loop recipe run unmodified, as a user runs
them, from an environment of their own (the cookbook pins its own transformers: scripts/setup.sh
makes it), through cookbook_recipes.py. The base model is a tiny random Llama served under the
recipe's model name (meta-llama/Llama-3.2-1B), its tokenizer registered with the cookbook, so
nothing is fetched from the hub. rl_loop's GSM8K rows and answer check are local stand-ins there
(a random model answers no sum right)."""
import json
import os
import subprocess
import sys

import pytest

from conftest import Executor, TinkerServer, add_tokenizer, make_checkpoint

# The cookbook's environment is the shared venv's sibling (scripts/setup.sh), unless said otherwise.
COOKBOOK_PYTHON = os.environ.get("SYMBIOSIS_COOKBOOK_PYTHON",
                                 os.path.join(os.path.dirname(sys.prefix), "cookbook-venv", "bin", "python"))
MODEL_NAME = "meta-llama/Llama-3.2-1B"
RECIPES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cookbook_recipes.py")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not os.path.exists(COOKBOOK_PYTHON):
        pytest.skip(f"no tinker-cookbook environment at {COOKBOOK_PYTHON}: scripts/setup.sh makes it")
    work = tmp_path_factory.mktemp("cookbook")
    checkpoint = make_checkpoint("llama", str(work / "model"))
    # Room for the recipes' conversations and prompts (the tiny model's own 64 positions are too few;
    # its RoPE takes any), before the executor hashes the checkpoint.
    config_path = os.path.join(checkpoint, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    with open(config_path, "w") as f:
        json.dump(dict(config, max_position_embeddings=1024), f)
    add_tokenizer(checkpoint)
    executor = Executor(checkpoint)
    running = None
    try:
        running = TinkerServer(["--executor", executor.endpoint, "--base-model", f"{MODEL_NAME}={checkpoint}",
                                "--state-dir", str(work / "state")], work / "tinker.log")
        running.checkpoint = checkpoint
        running.work = work
        yield running
    finally:
        if running is not None:
            running.stop()
        executor.stop()


def recipe(server, name):
    """The recipe's metrics, a dict a step, and its checkpoints.jsonl records."""
    log_dir = server.work / name
    env = dict(os.environ, TINKER_API_KEY=TinkerServer.KEY, TINKER_TELEMETRY="0", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", PYTHONPATH="")
    done = subprocess.run([COOKBOOK_PYTHON, RECIPES, name, server.url, MODEL_NAME, server.checkpoint, str(log_dir)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    steps = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    with open(log_dir / "checkpoints.jsonl") as f:
        checkpoints = [json.loads(line) for line in f]
    return steps, checkpoints


def test_the_supervised_recipe_trains_evaluates_and_saves(server):
    steps, checkpoints = recipe(server, "sl")
    assert [s["step"] for s in steps] == [0, 1, 2, 3]
    assert steps[-1]["train_mean_nll"] < steps[0]["train_mean_nll"]
    assert steps[2]["test/nll"] < steps[0]["test/nll"]  # its NLL evaluator: forward on held-out data
    final = checkpoints[-1]
    assert final["state_path"].startswith("tinker://") and final["sampler_path"].startswith("tinker://")


def test_the_rl_loop_recipe_samples_trains_and_saves(server):
    steps, checkpoints = recipe(server, "rl")
    assert [s["step"] for s in steps] == [0, 1]
    assert all(s["grad_norm:mean"] > 0 for s in steps)  # both batches trained (their groups' rewards differ)
    assert checkpoints[-1]["state_path"].endswith("/weights/final")
