"""symbiosis-serve measured through its HTTP API, as its users reach it: --requests concurrent
streamed completions (the official `openai` client, AsyncOpenAI) of --prompt random token ids and
--new-tokens greedy tokens each (`ignore_eos`), spread round-robin over the adapters in --adapters,
against the server decoding through an executor this script starts (`split`) and the same server
with the base layers its own (`--monolithic`), in the same run. The requests come from
--client-processes processes (4), so that one client process's Python is not what is measured.
Each is measured once warm (after a round of 4 new tokens a request); the figures are output
tokens/s (every request's tokens over the wall time from the first request to the last token), time
to first token and time per output token after the first (p50 and p99 over the requests), and the
mean time to first token the server itself counts from each request's arrival (its /metrics).

    python3 bench/serve_bench.py --build build --model DIR --adapters DIR/0 DIR/1 --device cuda:0 \
        --dtype bf16 --out /tmp/serve.json

The model and adapters may be symbiosis-bench-multi-lora's (--out/model-*, --out/adapters/*). A
model without a tokenizer (symbiosis-make-checkpoint writes none) is given a byte-level BPE one of
its vocabulary's size first (one token for each id, no merges: the prompts here are ids, and the
server only decodes).
"""
import argparse
import asyncio
import json
import multiprocessing
import os
import random
import sys
import time

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from executor_process import ReadyProcess, executor_binary, start_executor
from harness import add_run_flags, write_json

# How long the executor (loading the model) and the server may take to say they are ready.
START_TIMEOUT_S = 600


def vocabulary_with_a_tokenizer(model):
    """The vocabulary size of the checkpoint `model`, which is given a tokenizer.json of that many
    tokens, each a distinct string of ByteLevel's alphabet, should it have no tokenizer."""
    vocab_size = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
    if any(os.path.exists(os.path.join(model, f)) for f in ("tokenizer.json", "tokenizer.model")):
        return vocab_size
    import tokenizers
    import transformers

    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    vocab = {}
    for i in range(vocab_size - 1):
        digits, n = [], i
        while True:
            digits.append(alphabet[n % 256])
            n //= 256
            if n == 0:
                break
        vocab["".join(digits)] = i
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|end|>"])  # the last id
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|end|>").save_pretrained(model)
    return vocab_size


def percentile(values, q):
    values = sorted(values)
    return values[int(q * (len(values) - 1) + 0.5)] if values else 0.0


async def one_request(client, model, prompt, new_tokens):
    """(time of each chunk's arrival, completion tokens) of one streamed completion."""
    times = []
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=new_tokens, temperature=0.0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
    tokens = 0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter())
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return times, tokens


async def server_ttft(server):
    """(sum of seconds, count) of the server's own time-to-first-token histogram, every adapter's
    (from each request's arrival at the server to its first token)."""
    async with httpx.AsyncClient() as http:
        text = (await http.get(server + "/metrics")).text
    total = count = 0.0
    for family in text_string_to_metric_families(text):
        if family.name == "symbiosis_time_to_first_token_seconds":
            for sample in family.samples:
                if sample.name.endswith("_sum"):
                    total += sample.value
                elif sample.name.endswith("_count"):
                    count += sample.value
    return total, count


def client(server, names, prompts, share, new_tokens, barrier, out):
    """One client process: warms up on its share of the prompts (indices), waits at `barrier` twice
    (warm; go), then streams them all at once; puts (start time, [(chunk times, tokens)]) on `out`."""
    async def run():
        async with openai.AsyncOpenAI(base_url=server + "/v1", api_key="unused", max_retries=0,
                                      timeout=600) as openai_client:
            await asyncio.gather(*(one_request(openai_client, names[i % len(names)], prompts[i], 4) for i in share))
            barrier.wait()
            barrier.wait()
            start = time.perf_counter()  # CLOCK_MONOTONIC: one clock for every process
            results = await asyncio.gather(*(one_request(openai_client, names[i % len(names)], prompts[i], new_tokens)
                                             for i in share))
        return start, results

    out.put(asyncio.run(run()))


def measure(server, names, prompts, new_tokens, processes):
    """The prompts streamed at once by `processes` client processes (round-robin shares)."""
    context = multiprocessing.get_context("spawn")
    barrier, out = context.Barrier(processes + 1), context.Queue()
    clients = [context.Process(target=client, args=(server, names, prompts, list(range(p, len(prompts), processes)),
                                                    new_tokens, barrier, out)) for p in range(processes)]
    for c in clients:
        c.start()
    barrier.wait()  # every client warm
    before = asyncio.run(server_ttft(server))
    barrier.wait()  # go
    shares = [out.get() for _ in clients]
    for c in clients:
        c.join()
    after = asyncio.run(server_ttft(server))
    start = min(s for s, _ in shares)
    results = [r for _, rs in shares for r in rs]
    tokens = sum(t for _, t in results)
    last = max(times[-1] for times, _ in results if times)
    ttft = [times[0] - start for times, _ in results if times]
    tpot = [(times[-1] - times[0]) / (t - 1) for times, t in results if len(times) > 1 and t > 1]
    return {"output_tokens": tokens, "output_tokens_per_s": tokens / (last - start),
            "ttft_p50_ms": 1e3 * percentile(ttft, 0.5), "ttft_p99_ms": 1e3 * percentile(ttft, 0.99),
            # The part of the time to first token inside the server (from a request's arrival there).
            "server_ttft_mean_ms": 1e3 * (after[0] - before[0]) / max(after[1] - before[1], 1),
            "tpot_p50_ms": 1e3 * percentile(tpot, 0.5), "tpot_p99_ms": 1e3 * percentile(tpot, 0.99)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_flags(parser, "the results (JSON); logs beside it")
    parser.add_argument("--adapters", nargs="+", required=True, help="PEFT LoRA adapter folders")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--max-lora-rank", type=int, default=64)
    parser.add_argument("--client-processes", type=int, default=4,
                        help="processes the requests are streamed from (one openai client each), so that the client's "
                             "own Python is not what is measured")
    parser.add_argument("--server-flags", default="", help="more of symbiosis-serve's flags, space-separated "
                        "(e.g. --server-flags=--no-capture-decode)")
    args = parser.parse_args()
    logs = os.path.splitext(args.out)[0]
    vocab = vocabulary_with_a_tokenizer(args.model)
    rng = random.Random(17)
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt)] for _ in range(args.requests)]
    names = [f"adapter-{i}" for i in range(len(args.adapters))]
    serve = [sys.executable, "-m", "symbiosis.serve", "--model", args.model, "--device", args.device, "--dtype",
             args.dtype, "--port", "0", "--max-num-seqs", str(args.requests), "--max-model-len",
             str(args.prompt + args.new_tokens), "--max-loras", str(len(names)), "--max-lora-rank",
             str(args.max_lora_rank), *args.server_flags.split(), "--lora-modules"] + \
        [f"{n}={d}" for n, d in zip(names, args.adapters)]
    results = {"requests": args.requests, "prompt": args.prompt, "new_tokens": args.new_tokens,
               "adapters": len(names), "client_processes": args.client_processes}
    with start_executor(executor_binary(args.build), args.model,
                        ["--device", args.device, "--dtype", args.dtype, "--log-level", "warn"],
                        logs + "-executor.log", START_TIMEOUT_S) as executor:
        for mode, extra in (("split", ["--executor", executor.address]), ("monolithic", ["--monolithic"])):
            with ReadyProcess(serve + extra, f"{logs}-{mode}.log", "symbiosis-serve") as server:
                server.wait_ready(START_TIMEOUT_S)
                results[mode] = measure(server.address, names, prompts, args.new_tokens, args.client_processes)
            print(mode, json.dumps(results[mode]), flush=True)
    results["split_of_monolithic"] = (results["split"]["output_tokens_per_s"] /
                                      results["monolithic"]["output_tokens_per_s"])
    write_json(args.out, results, echo=True)


if __name__ == "__main__":
    main()
