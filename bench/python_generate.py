"""A Python tenant's generation: symbiosis.Generator (the C++ engine, [Python generation] in
python/symbiosis/generation.py) against transformers + PEFT `generate` on the same model and LoRA
adapter, in the same run. Both generate greedily for `--prompts` prompts of `--prompt-tokens` tokens,
`--new-tokens` each (no stop token), transformers as one left-padded batch; the figure is output
tokens per second, best of `--repeats`. The Generator runs split (base layers on an executor this
script starts) and monolithic.

    python3 bench/python_generate.py --build build --preset tiny-llama --device cpu --out /tmp/pygen.json
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time

import peft
import torch
import transformers

import symbiosis
from executor_process import executor_binary, start_executor
from harness import add_run_flags, write_json


def best_seconds(run, repeats):
    best = float("inf")
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_flags(parser, "the results (JSON)", model=False, device="cpu", dtype="fp32", dtypes=("fp32", "bf16"))
    parser.add_argument("--preset", default="tiny-llama", help="symbiosis-make-checkpoint's preset")
    parser.add_argument("--layers", type=int, default=0, help="the preset's layers (0: its own)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    work = tempfile.mkdtemp(prefix="python-generate-")
    model_dir, adapter_dir = os.path.join(work, "model"), os.path.join(work, "adapter")
    make = [os.path.join(args.build, "tools", "symbiosis-make-checkpoint"), "--preset", args.preset, "--dtype",
            args.dtype, "--out", model_dir] + (["--layers", str(args.layers)] if args.layers else [])
    subprocess.run(make, check=True, stdout=subprocess.DEVNULL)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(args.device).eval()
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    model.save_pretrained(adapter_dir)
    vocab = model.config.vocab_size
    prompts = torch.randint(3, vocab, (args.prompts, args.prompt_tokens)).tolist()
    produced = args.prompts * args.new_tokens

    def transformers_generate():
        with torch.no_grad():
            ids = torch.tensor(prompts, device=args.device)
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                           min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)

    figures = {"transformers_peft_generate": produced / best_seconds(transformers_generate, args.repeats)}
    with start_executor(executor_binary(args.build), model_dir, ["--device", args.device],
                        os.path.join(work, "executor.log")) as executor:
        split = symbiosis.Client.connect(executor.address, device=args.device)
        for name, client in (("symbiosis_generator_split", split), ("symbiosis_generator_monolithic", None)):
            generator = symbiosis.Generator(model_dir, client, adapter=adapter_dir, device=args.device, dtype=dtype,
                                            max_sequences=args.prompts,
                                            max_tokens=args.prompt_tokens + args.new_tokens)
            run = lambda: generator.generate(prompts, max_new_tokens=args.new_tokens)  # noqa: E731
            run()  # warm-up (on a GPU, the decode graphs are captured here)
            figures[name] = produced / best_seconds(run, args.repeats)
    base = figures["transformers_peft_generate"]
    result = {"settings": vars(args), "output_tokens_per_s": figures,
              "against_transformers": {k: v / base for k, v in figures.items()}}
    write_json(args.out, result, indent=1)
    for name, value in figures.items():
        print(f"{name:<32} {value:10.1f} output tokens/s  {value / base:6.2f}x transformers + PEFT generate")
    return 0


if __name__ == "__main__":
    sys.exit(main())
