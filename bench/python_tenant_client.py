"""One Python fine-tuning job of the Python-tenant benchmark (issue 29; bench/python_tenants.py runs it):
transformers' model of --model with PEFT LoRA (--rank, --alpha, --targets) and AdamW, fine-tuned on
--batch random sequences of --seq tokens, in the model's dtype, SDPA attention (transformers' default).

With --executor it is a Python tenant: `symbiosis.from_pretrained` builds the model without its base
layers, which run on that executor through the C++ client (cuda-ipc on the executor's GPU); without
it the same job holds its own copy of the base (plain transformers + PEFT, the baseline). Nothing
else differs: the same script, model code, adapters, optimizer and step.

Protocol ([Measurement window] in bench/bench_client.cpp, as symbiosis-bench-client and
bench/hf_peft_client.py): --warmup untimed steps, then --ready-file is created; with --stop-file it
steps until that file exists (capacity runs), with --go-file it waits for that file and steps through
the window it names, else it runs --iterations steps. The JSON (--out) has the same keys as theirs,
and each step's end time (`step_end_epoch_s`), so that a window can be cut from a capacity run.
A step that runs out of memory ends the process with status 3, saying so.
"""
import argparse
import json
import os
import resource
import sys
import time

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
OUT_OF_MEMORY = 3


def build_model(a, device):
    """(model with LoRA, client or None)."""
    import peft
    from transformers import AutoModelForCausalLM

    dtype = DTYPES[a.dtype]
    client = None
    if a.executor:
        import symbiosis

        client = symbiosis.Client.connect(a.executor, tenant=f"python-{a.seed}", device=str(device))
        model = symbiosis.from_pretrained(a.model, client, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype, device_map=device)
    for p in model.parameters():
        p.requires_grad_(False)
    if a.gradient_checkpointing:
        # transformers' own: each decoder layer's activations recomputed in backward (the virtual
        # layers call the executor again there); the adapters then need an input that requires grad.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    config = peft.LoraConfig(r=a.rank, lora_alpha=a.alpha, lora_dropout=0.0, target_modules=a.targets.split(","),
                             task_type="CAUSAL_LM")
    # Adapters in the model's dtype, as Symbiosis's C++ tenants keep them (PEFT would upcast to fp32).
    model = peft.get_peft_model(model, config, autocast_adapter_dtype=False)
    model.train()
    return model, client


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="checkpoint directory (the executor's, for a tenant)")
    p.add_argument("--executor", default="", help="executor endpoint: a Python tenant; empty: plain transformers")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16)
    p.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj")
    p.add_argument("--gradient-checkpointing", action="store_true", help="transformers' gradient checkpointing")
    p.add_argument("--iterations", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op CPU threads (symbiosis-bench-client's default: many jobs share the host's cores)")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--ready-file")
    p.add_argument("--go-file")
    p.add_argument("--stop-file")
    p.add_argument("--out", required=True)
    a = p.parse_args()

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    device = torch.device(a.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        model, client = build_model(a, device)
    except torch.OutOfMemoryError as error:
        print(f"python_tenant_client: out of GPU memory while loading: {str(error).splitlines()[0]}", file=sys.stderr)
        sys.exit(OUT_OF_MEMORY)
    optimizer = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (a.batch, a.seq), device=device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        if client is not None:
            client.settle()  # every base-layer call has its result before the adapters change
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    ends, latencies = [], []

    def timed_step() -> None:
        t0 = time.time()
        step()
        ends.append(time.time())
        latencies.append(ends[-1] - t0)

    try:
        for _ in range(a.warmup):
            step()
        if a.ready_file:
            with open(a.ready_file, "w") as f:
                f.write("warm\n")
        if a.stop_file:
            start = time.time()
            while not os.path.exists(a.stop_file):
                timed_step()
            end = time.time()
        elif a.go_file:
            while not os.path.exists(a.go_file):
                time.sleep(0.005)
            time.sleep(0.02)
            with open(a.go_file) as f:
                start, end = (float(v) for v in f.read().split())
            while time.time() < end:
                timed_step()
        else:
            start = time.time()
            for _ in range(a.iterations):
                timed_step()
            end = time.time()
    except torch.OutOfMemoryError as error:
        print(f"python_tenant_client: out of GPU memory ({'tenant' if client else 'plain transformers'}): "
              f"{str(error).splitlines()[0]}", file=sys.stderr)
        sys.exit(OUT_OF_MEMORY)

    in_window = [latency for latency, t in zip(latencies, ends) if start <= t <= end]
    tokens = a.batch * a.seq
    result = {
        "system": "python_tenant" if client else "python_plain",
        "mode": "finetune",
        "monolithic": client is None,
        "transport": client.transport if client else "none",
        "gradient_checkpointing": a.gradient_checkpointing,
        "device": a.device,
        "batch": a.batch,
        "seq": a.seq,
        "rank": a.rank,
        "iterations": len(in_window),
        "tokens_per_iteration": tokens,
        "latencies_s": in_window,
        "step_end_epoch_s": ends,
        "start_epoch_s": start,
        "end_epoch_s": end,
        "tokens_per_s": tokens * len(in_window) / max(end - start, 1e-9),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "gpu_peak_reserved_bytes": torch.cuda.max_memory_reserved(device) if device.type == "cuda" else 0,
        "gpu_peak_allocated_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0,
    }
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
