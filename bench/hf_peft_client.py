"""The Hugging Face PEFT baseline: one independent fine-tuning job, as a tenant would run it
without Symbiosis: transformers' LlamaForCausalLM (its default attention, SDPA) with its own copy of
the base model, PEFT LoRA on the same targets, rank and alpha, AdamW, the same batch shape.

--mode generate: each iteration generates --new-tokens greedy tokens for --batch prompts of --seq
tokens with `generate`, the rows spread over --adapters LoRA adapters in one mixed batch (PEFT's
`adapter_names`): the multi-adapter inference baseline.

It follows symbiosis-bench-client's [Measurement window] protocol (see bench/bench_client.cpp; its
Python side is bench/harness.py's) and writes the same JSON, so symbiosis-bench runs it side by side
with Symbiosis:
  python3 bench/hf_peft_client.py --model DIR --batch 2 --seq 512 --rank 8 --device cuda:0 --out r.json
"""
import argparse

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from harness import add_client_flags, client_result, run_window, torch_dtype, write_json


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_client_flags(p)
    p.add_argument("--mode", default="finetune", choices=["finetune", "inference", "generate"])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--adapters", type=int, default=1)
    p.add_argument("--device", default="cuda:0")
    p.set_defaults(batch=1, seq=64, targets="q_proj,v_proj")
    a = p.parse_args()

    torch.manual_seed(a.seed)
    device = torch.device(a.device)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch_dtype(a.dtype), device_map=device)
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
    window = run_window(a, iteration)
    tokens = a.batch * (a.new_tokens if a.mode == "generate" else a.seq)
    write_json(a.out, client_result(
        a, window, "hf_peft", tokens, mode=a.mode,
        gpu_peak_reserved_bytes=torch.cuda.max_memory_reserved(device) if device.type == "cuda" else 0))


if __name__ == "__main__":
    main()
