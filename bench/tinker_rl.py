"""K concurrent RL runs through symbiosis-tinker, as users of the Tinker API run them, against the
same K runs one after another. Each run (its own tinker ServiceClient, in a thread of this
process) does --steps steps of: save_weights_and_get_sampling_client, sample a group of --group
completions of --max-tokens tokens for each of --prompts prompts of --prompt-len random tokens,
score each token (in the vocabulary's lower half: 1), importance_sampling forward_backward of the
group, optim_step. The figure is experiment throughput, steps of all runs over the wall time, from
the runs' first step (their workers built) to their last; "one after another" is K times a single
run's time measured in the same invocation (the runs are alike). Also each run's sample and train
times a step and the GPU's memory in use with K runs' workers alive.

    python3 bench/tinker_rl.py --build build --model DIR --runs 1,4,8 --device cuda:0 --dtype bf16 \
        --out /tmp/tinker-rl.json

The model is a checkpoint folder (e.g. symbiosis-make-checkpoint's llama-3.2-1b); one without a
tokenizer gets serve_bench.py's byte-level one.
"""
import argparse
import json
import os
import random
import sys
import threading
import time

import numpy as np
import tinker
from tinker import types

from executor_process import ReadyProcess, executor_binary, start_executor
from harness import add_run_flags, gpu_memory_mib, write_json
from serve_bench import START_TIMEOUT_S, vocabulary_with_a_tokenizer

BASE = "bench/model"


def one_run(url, args, vocab, seed, record):
    """A run's steps; record: its dict (sample_s, train_s per step; start and end times)."""
    service = tinker.ServiceClient(base_url=url, api_key="tml-bench")
    training = service.create_lora_training_client(base_model=BASE, rank=args.rank, seed=seed).result()
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    record.update(sample_s=[], train_s=[], ready=time.perf_counter())
    record["go"].wait()
    record["start"] = time.perf_counter()
    for step in range(args.steps):
        t0 = time.perf_counter()
        sampler = training.save_weights_and_get_sampling_client()
        params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=seed * 1000 + step, stop=[])
        groups = [sampler.sample(types.ModelInput.from_ints(p), args.group, params) for p in prompts]
        data = []
        for prompt, group in zip(prompts, groups):
            for sequence in group.result().sequences:
                hits = [float(t < vocab // 2) for t in sequence.tokens]
                mean = sum(hits) / len(hits)
                n = len(prompt) - 1
                data.append(types.Datum(
                    model_input=types.ModelInput.from_ints(prompt + sequence.tokens[:-1]),
                    loss_fn_inputs={"target_tokens": prompt[1:] + sequence.tokens,
                                    "logprobs": [0.0] * n + sequence.logprobs,
                                    "advantages": [0.0] * n + [h - mean for h in hits]}))
        t1 = time.perf_counter()
        backward = training.forward_backward(data, "importance_sampling")
        training.optim_step(types.AdamParams(learning_rate=1e-4)).result()
        backward.result()
        t2 = time.perf_counter()
        record["sample_s"].append(t1 - t0)
        record["train_s"].append(t2 - t1)
    record["end"] = time.perf_counter()
    service.close("success").result()  # the run's worker ends (its GPU memory goes back)


def concurrent(url, args, vocab, k, first_seed):
    go = threading.Event()
    records = [{"go": go} for _ in range(k)]
    threads = [threading.Thread(target=one_run, args=(url, args, vocab, first_seed + i, records[i])) for i in range(k)]
    for t in threads:
        t.start()
    while not all("ready" in r for r in records):
        if not any(t.is_alive() for t in threads):
            raise RuntimeError("every run ended before its first step")
        time.sleep(0.05)
    memory = gpu_memory_mib(0)[0]
    go.set()
    for t in threads:
        t.join()
    if not all("end" in r for r in records):
        raise RuntimeError(f"{sum('end' not in r for r in records)} of {k} runs failed")
    wall = max(r["end"] for r in records) - min(r["start"] for r in records)
    return {"runs": k, "wall_s": wall, "steps_per_s": k * args.steps / wall, "gpu_memory_mib": memory,
            "sample_s_per_step": float(np.mean([s for r in records for s in r["sample_s"]])),
            "train_s_per_step": float(np.mean([s for r in records for s in r["train_s"]]))}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_flags(parser, "the results (JSON); logs beside it")
    parser.add_argument("--runs", default="1,4,8", help="the counts K of concurrent runs")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4, help="prompts a step")
    parser.add_argument("--group", type=int, default=8, help="completions a prompt")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    logs = os.path.splitext(args.out)[0]
    vocab = vocabulary_with_a_tokenizer(args.model)
    counts = [int(k) for k in args.runs.split(",")]
    with start_executor(executor_binary(args.build), args.model,
                        ["--device", args.device, "--dtype", args.dtype, "--log-level", "warn"],
                        logs + "-executor.log", START_TIMEOUT_S) as executor, \
            ReadyProcess([sys.executable, "-m", "symbiosis.tinker", "--executor", executor.address, "--base-model",
                          f"{BASE}={args.model}", "--port", "0", "--device", args.device, "--dtype", args.dtype,
                          "--state-dir", logs + "-state", "--max-num-seqs", "256",
                          "--max-model-len", str(args.prompt_len + args.max_tokens),
                          "--max-loras", str(2 * max(counts) + 2)], logs + "-server.log", "symbiosis-tinker") as server:
        url = server.wait_ready(START_TIMEOUT_S).address
        results = {"settings": {k: v for k, v in vars(args).items() if k not in ("build", "out")},
                   "idle_gpu_memory_mib": gpu_memory_mib(0)[0], "concurrent": []}
        # A run of one step first, not counted: the sampler's first decode steps (their graph
        # captures) and the first worker's start-up would otherwise be charged to K = 1 alone.
        concurrent(url, argparse.Namespace(**dict(vars(args), steps=1)), vocab, 1, 0)
        seed = 1
        for k in counts:
            results["concurrent"].append(concurrent(url, args, vocab, k, seed))
            seed += k
            print(json.dumps(results["concurrent"][-1]), flush=True)
    single = next(r for r in results["concurrent"] if r["runs"] == 1)["wall_s"]
    for r in results["concurrent"]:
        r["one_after_another_s"] = r["runs"] * single
        r["throughput_vs_one_after_another"] = r["runs"] * single / r["wall_s"]
    write_json(args.out, results, echo=True)


if __name__ == "__main__":
    main()
