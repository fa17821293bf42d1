"""symbiosis-serve measured through its HTTP API, as its users reach it: --requests concurrent
streamed completions (the official `openai` client, AsyncOpenAI) of --prompt random token ids and
--new-tokens greedy tokens each (`ignore_eos`), spread round-robin over the adapters in --adapters,
against the server decoding through an executor this script starts (`split`) and the same server
with the base layers its own (`--monolithic`), in the same run. Each is measured once warm (after a
round of 4 new tokens a request); the figures are output tokens/s (every request's tokens over the
wall time from the first request to the last token), time to first token and time per output token
after the first (p50 and p99 over the requests).

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
import os
import random
import sys
import time

import openai

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


async def measure(base_url, names, prompts, new_tokens):
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600) as client:
        await asyncio.gather(*(one_request(client, names[i % len(names)], p, 4) for i, p in enumerate(prompts)))
        start = time.perf_counter()
        results = await asyncio.gather(*(one_request(client, names[i % len(names)], p, new_tokens)
                                         for i, p in enumerate(prompts)))
    tokens = sum(t for _, t in results)
    last = max(times[-1] for times, _ in results if times)
    ttft = [times[0] - start for times, _ in results if times]
    tpot = [(times[-1] - times[0]) / (t - 1) for times, t in results if len(times) > 1 and t > 1]
    return {"output_tokens": tokens, "output_tokens_per_s": tokens / (last - start),
            "ttft_p50_ms": 1e3 * percentile(ttft, 0.5), "ttft_p99_ms": 1e3 * percentile(ttft, 0.99),
            "tpot_p50_ms": 1e3 * percentile(tpot, 0.5), "tpot_p99_ms": 1e3 * percentile(tpot, 0.99)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_flags(parser, "the results (JSON); logs beside it")
    parser.add_argument("--adapters", nargs="+", required=True, help="PEFT LoRA adapter folders")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--max-lora-rank", type=int, default=64)
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
               "adapters": len(names)}
    with start_executor(executor_binary(args.build), args.model,
                        ["--device", args.device, "--dtype", args.dtype, "--log-level", "warn"],
                        logs + "-executor.log", START_TIMEOUT_S) as executor:
        for mode, extra in (("split", ["--executor", executor.address]), ("monolithic", ["--monolithic"])):
            with ReadyProcess(serve + extra, f"{logs}-{mode}.log", "symbiosis-serve") as server:
                server.wait_ready(START_TIMEOUT_S)
                results[mode] = asyncio.run(measure(server.address + "/v1", names, prompts, args.new_tokens))
            print(mode, json.dumps(results[mode]), flush=True)
    results["split_of_monolithic"] = (results["split"]["output_tokens_per_s"] /
                                      results["monolithic"]["output_tokens_per_s"])
    write_json(args.out, results, echo=True)


if __name__ == "__main__":
    main()
