#!/usr/bin/env python3
"""How far does a last-bit reordering of the base GEMMs move a LoRA tenant's logits and gradients?

The soak's exactness bound on a GPU executor ([Soak exactness] in bench/soak_client.cpp) rests on
this: a LoRA model (transformers + PEFT, fp32, on the CPU) trains with AdamW as a soak client does,
and at every step its loss is differentiated twice, once as it is and once with every base
projection's GEMM reduced in another order (K split in two halves, as another GEMM kernel may
reduce). Printed: the largest relative difference of the logits (of max |logits|) and of the
adapter gradients (of the step's largest adapter gradient) over the steps, and the gradients'
quantiles.

  python3 bench/reorder_sensitivity.py --model DIR [--r 2] [--alpha 2] [--targets gate_proj,up_proj,down_proj] [--steps 6000]
DIR: a checkpoint, e.g. symbiosis-make-checkpoint --preset tiny-llama --out DIR.
"""
import argparse

import numpy as np
import peft
import torch
import transformers

BASE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--r", type=int, default=2)
    parser.add_argument("--alpha", type=float, default=2.0)
    parser.add_argument("--targets", default="gate_proj,up_proj,down_proj")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model = peft.get_peft_model(model, peft.LoraConfig(r=args.r, lora_alpha=args.alpha, target_modules=args.targets.split(","),
                                                       init_lora_weights=False))
    adapter = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(adapter, lr=1e-3)
    reorder = {"on": False}

    def split_k(module, inputs, output):
        if not reorder["on"]:
            return None
        x, w = inputs[0], module.weight
        h = x.shape[-1] // 2
        return torch.nn.functional.linear(x[..., :h], w[:, :h]) + torch.nn.functional.linear(x[..., h:], w[:, h:])

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.split(".")[-1] in BASE:
            module.register_forward_hook(split_k)
        if isinstance(module, peft.tuners.lora.Linear):
            module.base_layer.register_forward_hook(split_k)
    logits_worst, gradients = 0.0, []
    for _ in range(args.steps):
        batch, seq = torch.randint(1, 4, ()).item(), torch.randint(4, 33, ()).item()
        ids = torch.randint(0, model.config.vocab_size, (batch, seq))
        runs = []
        for on in (False, True):
            reorder["on"] = on
            for p in adapter:
                p.grad = None
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            runs.append((out.logits.detach(), [p.grad.clone() for p in adapter]))
        reorder["on"] = False
        (logits, grads), (logits2, grads2) = runs
        largest = max(g.abs().max().item() for g in grads)
        gradients.append(max((a - b).abs().max().item() for a, b in zip(grads, grads2)) / largest)
        logits_worst = max(logits_worst, (logits - logits2).abs().max().item() / logits.abs().max().item())
        optimizer.step()
    g = np.array(gradients)
    print(f"{args.steps} steps, r={args.r}, alpha={args.alpha}, targets {args.targets}: logits up to {logits_worst:.2e}; "
          f"gradients median {np.median(g):.2e}, 99% {np.quantile(g, .99):.2e}, 99.9% {np.quantile(g, .999):.2e}, "
          f"max {g.max():.2e}")


if __name__ == "__main__":
    main()
