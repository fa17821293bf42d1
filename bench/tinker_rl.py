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
import subprocess
import sys
import threading
import time

import numpy as np
import tinker
from tinker import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_bench import add_byte_level_tokenizer, started  # noqa: E402

BASE = "bench/model"


def gpu_memory_mib():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, check=True).stdout
        return float(out.split()[0])
    except (OSError, subprocess.CalledProcessError, ValueError, IndexError):
        return 0.0


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
    memory = gpu_memory_mib()
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
    parser.add_argument("--build", required=True, help="the build folder (its executor)")
    parser.add_argument("--model", required=True, help="the base model's checkpoint folder")
    parser.add_argument("--runs", default="1,4,8", help="the counts K of concurrent runs")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4, help="prompts a step")
    parser.add_argument("--group", type=int, default=8, help="completions a prompt")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--out", required=True, help="the results (JSON); logs beside it")
    args = parser.parse_args()
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    logs = os.path.splitext(args.out)[0]
    vocab = json.load(open(os.path.join(args.model, "config.json")))["vocab_size"]
    if not any(os.path.exists(os.path.join(args.model, f)) for f in ("tokenizer.json", "tokenizer.model")):
        add_byte_level_tokenizer(args.model, vocab)
    counts = [int(k) for k in args.runs.split(",")]
    executor, endpoint = started([os.path.join(args.build, "base_executor", "symbiosis-executor"), "--model",
                                  args.model, "--listen", "tcp://127.0.0.1:*", "--device", args.device, "--dtype",
                                  args.dtype, "--log-level", "warn"], "ready ", logs + "-executor.log")
    server, url = started([sys.executable, "-m", "symbiosis.tinker", "--executor", endpoint, "--base-model",
                           f"{BASE}={args.model}", "--port", "0", "--device", args.device, "--dtype", args.dtype,
                           "--state-dir", logs + "-state", "--max-num-seqs", "256",
                           "--max-model-len", str(args.prompt_len + args.max_tokens),
                           "--max-loras", str(2 * max(counts) + 2)], "ready ", logs + "-server.log")
    results = {"settings": {k: v for k, v in vars(args).items() if k not in ("build", "out")}, "idle_gpu_memory_mib":
               gpu_memory_mib(), "concurrent": []}
    try:
        # A run of one step first, not counted: the sampler's first decode steps (their graph
        # captures) and the first worker's start-up would otherwise be charged to K = 1 alone.
        concurrent(url, argparse.Namespace(**dict(vars(args), steps=1)), vocab, 1, 0)
        seed = 1
        for k in counts:
            results["concurrent"].append(concurrent(url, args, vocab, k, seed))
            seed += k
            print(json.dumps(results["concurrent"][-1]), flush=True)
    finally:
        server.terminate()
        server.wait()
        executor.terminate()
        executor.wait()
    single = next(r for r in results["concurrent"] if r["runs"] == 1)["wall_s"]
    for r in results["concurrent"]:
        r["one_after_another_s"] = r["runs"] * single
        r["throughput_vs_one_after_another"] = r["runs"] * single / r["wall_s"]
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
