#!/usr/bin/env python3
"""Reference logits from transformers, for the C++ tests.

Loads a checkpoint directory with AutoModelForCausalLM (CPU, fp32, eager attention), runs the
input ids (and optional attention mask) of a safetensors file, and writes the logits to another.

  hf_logits.py --checkpoint DIR --inputs IN.safetensors --output OUT.safetensors

IN holds "input_ids" [B,T] and optionally "attention_mask" and "labels" [B,T], in any dtype (the
C++ side writes them as fp32, which holds small integers exactly; they are read as int64); OUT holds
"logits" [B,T,V] fp32 and, when IN holds "labels", "loss" (transformers' causal LM loss).
Exit status 3 when transformers is not installed (the C++ test then skips).
"""
import argparse
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--inputs", required=True)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    try:
        import torch
        import transformers
        from safetensors.torch import load_file, save_file
    except ImportError as e:
        print(f"missing Python package: {e}", file=sys.stderr)
        return 3

    inputs = load_file(args.inputs)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        args.checkpoint, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    kwargs = {k: inputs[k].long() for k in ("input_ids", "attention_mask", "labels") if k in inputs}
    with torch.no_grad():
        out = model(**kwargs, use_cache=False)
    result = {"logits": out.logits.float().contiguous()}
    if "labels" in inputs:
        result["loss"] = out.loss.float().reshape(1)
    save_file(result, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
