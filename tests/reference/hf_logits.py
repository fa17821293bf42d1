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
import sys

from reference import inputs_and_model, missing, reference_parser


def main() -> int:
    args = reference_parser(__doc__.splitlines()[0]).parse_args()
    try:
        import torch
        import transformers  # noqa: F401 (reference_model loads with it)
        from safetensors.torch import save_file
    except ImportError as e:
        return missing(e)

    inputs, model = inputs_and_model(args)
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
