"""One Python fine-tuning job of the Python-tenant benchmark (issue 29; bench/python_tenants.py runs it):
transformers' model of --model with PEFT LoRA (--rank, --alpha, --targets) and AdamW, fine-tuned on
--batch random sequences of --seq tokens, in the model's dtype, SDPA attention (transformers' default).

With --executor it is a Python tenant: `symbiosis.from_pretrained` builds the model without its base
layers, which run on that executor through the C++ client (cuda-ipc on the executor's GPU); without
it the same job holds its own copy of the base (plain transformers + PEFT, the baseline). Nothing
else differs: the same script, model code, adapters, optimizer and step.

Protocol ([Measurement window] in bench/bench_client.cpp, as symbiosis-bench-client and
bench/hf_peft_client.py; harness.run_window): --warmup untimed steps, then --ready-file is created; with --stop-file it
steps until that file exists (capacity runs), with --go-file it waits for that file and steps through
the window it names, else it runs --iterations steps. The JSON (--out) has the same keys as theirs,
and each step's end time (`step_end_epoch_s`), so that a window can be cut from a capacity run.
A step that runs out of memory ends the process with status 3, saying so.
"""
import argparse
import sys

import torch

from harness import add_client_flags, client_result, run_window, torch_dtype, write_json

OUT_OF_MEMORY = 3


def build_model(a, device):
    """(model with LoRA, client or None)."""
    import peft
    from transformers import AutoModelForCausalLM

    dtype = torch_dtype(a.dtype)
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
    add_client_flags(p)
    p.add_argument("--executor", default="", help="executor endpoint: a Python tenant; empty: plain transformers")
    p.add_argument("--gradient-checkpointing", action="store_true", help="transformers' gradient checkpointing")
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op CPU threads (symbiosis-bench-client's default: many jobs share the host's cores)")
    p.add_argument("--device", default="cuda:0")
    p.set_defaults(iterations=5)
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

    try:
        window = run_window(a, step)
    except torch.OutOfMemoryError as error:
        print(f"python_tenant_client: out of GPU memory ({'tenant' if client else 'plain transformers'}): "
              f"{str(error).splitlines()[0]}", file=sys.stderr)
        sys.exit(OUT_OF_MEMORY)

    cuda = device.type == "cuda"
    write_json(a.out, client_result(
        a, window, "python_tenant" if client else "python_plain", a.batch * a.seq, monolithic=client is None,
        transport=client.transport if client else "none", gradient_checkpointing=a.gradient_checkpointing,
        step_end_epoch_s=window.step_ends,
        gpu_peak_reserved_bytes=torch.cuda.max_memory_reserved(device) if cuda else 0,
        gpu_peak_allocated_bytes=torch.cuda.max_memory_allocated(device) if cuda else 0))


if __name__ == "__main__":
    main()
