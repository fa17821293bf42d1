"""The Hugging Face PEFT baseline: one independent fine-tuning job, as a tenant would run it
without Symbiosis: transformers' LlamaForCausalLM (its default attention, SDPA) with its own copy of
the base model, PEFT LoRA on the same targets, rank and alpha, AdamW, the same batch shape.

--mode generate: each iteration generates --new-tokens greedy tokens for --batch prompts of --seq
tokens with `generate`, the rows spread over --adapters LoRA adapters in one mixed batch (PEFT's
`adapter_names`): the multi-adapter inference baseline.

It follows symbiosis-bench-client's [Measurement window] protocol (see bench/bench_client.cpp) and
writes the same JSON, so symbiosis-bench runs it side by side with Symbiosis:
  python3 bench/hf_peft_client.py --model DIR --batch 2 --seq 512 --rank 8 --device cuda:0 --out r.json
"""
import argparse
import json
import os
import resource
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--mode", default="finetune", choices=["finetune", "inference", "generate"])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--adapters", type=int, default=1)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16)
    p.add_argument("--targets", default="q_proj,v_proj")
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--ready-file")
    p.add_argument("--go-file")
    p.add_argument("--stop-file")
    p.add_argument("--out", required=True)
    a = p.parse_args()

    torch.manual_seed(a.seed)
    device = torch.device(a.device)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=DTYPES[a.dtype], device_map=device)
    config = LoraConfig(r=a.rank, lora_alpha=a.alpha, lora_dropout=0.0, target_modules=a.targets.split(","),
                        task_type="CAUSAL_LM")
    # Adapters in the model's dtype, as Symbiosis keeps them (PEFT would otherwise upcast to fp32).
    model = get_peft_model(model, config, autocast_adapter_dtype=False, adapter_name="a0")
    for k in range(1, a.adapters):
        model.add_adapter(f"a{k}", config)
    adapter_names = [f"a{row % a.adapters}" for row in range(a.batch)]
    optimizer = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (a.batch, a.seq), device=device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def iteration() -> None:
        if a.mode == "finetune":
            optimizer.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
        elif a.mode == "generate":
            with torch.inference_mode():
                kwargs = {"adapter_names": adapter_names} if a.adapters > 1 else {}
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, eos_token_id=None,
                               pad_token_id=0, **kwargs)
        else:
            with torch.inference_mode():
                model(input_ids=ids)
        sync()

    model.train(a.mode == "finetune")
    for _ in range(a.warmup):
        iteration()
    latencies = []
    if a.ready_file:
        with open(a.ready_file, "w") as f:
            f.write("warm\n")
    if a.stop_file:
        start = time.time()
        while not os.path.exists(a.stop_file):
            t0 = time.time()
            iteration()
            latencies.append(time.time() - t0)
        end = time.time()
    elif a.go_file:
        while not os.path.exists(a.go_file):
            time.sleep(0.005)
        time.sleep(0.02)
        with open(a.go_file) as f:
            start, end = (float(v) for v in f.read().split())
        while time.time() < end:
            t0 = time.time()
            iteration()
            t1 = time.time()
            if start <= t1 <= end:
                latencies.append(t1 - t0)
    else:
        start = time.time()
        for _ in range(a.iterations):
            t0 = time.time()
            iteration()
            latencies.append(time.time() - t0)
        end = time.time()

    tokens = a.batch * (a.new_tokens if a.mode == "generate" else a.seq)
    result = {
        "system": "hf_peft",
        "mode": a.mode,
        "monolithic": True,
        "transport": "none",
        "device": a.device,
        "batch": a.batch,
        "seq": a.seq,
        "rank": a.rank,
        "iterations": len(latencies),
        "tokens_per_iteration": tokens,
        "latencies_s": latencies,
        "start_epoch_s": start,
        "end_epoch_s": end,
        "tokens_per_s": tokens * len(latencies) / max(end - start, 1e-9),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "gpu_peak_reserved_bytes": torch.cuda.max_memory_reserved(device) if device.type == "cuda" else 0,
    }
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
