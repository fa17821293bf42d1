#!/usr/bin/env python3
"""Hugging Face transformers + PEFT greedy generation: the reference for the generation tests (CPU, fp32).

  peft_generate.py --checkpoint DIR --inputs IN --output OUT --new-tokens N [--method M --adapter ADAPTER]

With --method, creates a PEFT adapter of method M with non-trivial random weights (as peft_interop.py
makes them) and saves it to ADAPTER; without, generates from the base model. IN holds prompts
"prompt_0", "prompt_1", ... (token ids, any dtype, 1-D); each is generated alone (no padding), greedy,
exactly N new tokens (no end-of-sequence token), three ways; OUT gets, for prompt i (fp32 token ids, N each):
  "forward_i"          greedy by the model's forward over the whole sequence at each step (PeftModel's
                       forward, what training computes);
  "generate_i"         `generate` (with its KV cache);
  "generate_nocache_i" `generate(use_cache=False)`.
With peft 0.21 / transformers 5.24 the three agree for LoRA and IA3; for prompt tuning the cached
`generate` departs from the other two after two tokens, and for prefix tuning both `generate`s
depart from the forward (and from each other) after the first token.
Exit status 3 when a Python package is missing (the C++ test then skips).
"""
import sys

from peft_interop import make_config
from reference import inputs_and_model, missing, reference_parser


def main() -> int:
    parser = reference_parser(__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, required=True)
    parser.add_argument("--method")
    parser.add_argument("--adapter")
    args = parser.parse_args()
    try:
        import torch
        import peft
        from safetensors.torch import save_file
    except ImportError as e:
        return missing(e)

    inputs, model = inputs_and_model(args)
    if args.method:
        torch.manual_seed(99)
        model = peft.get_peft_model(model, make_config(peft, args.method, model.config.model_type))
        with torch.no_grad():
            for name, p in model.named_parameters():
                # LoRA's B and IA3's vectors start where the adapter changes nothing: move them off.
                if "lora_B" in name or "ia3_l" in name:
                    p.add_(torch.randn_like(p) * 0.3)
        model.save_pretrained(args.adapter)
    model.eval()
    outputs = {}
    for i in range(len(inputs)):
        prompt = inputs[f"prompt_{i}"].long().view(1, -1)
        with torch.no_grad():
            ids = prompt
            for _ in range(args.new_tokens):
                logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
                ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], 1)
            outputs[f"forward_{i}"] = ids[0, -args.new_tokens:].float().contiguous()
            for name, use_cache in (("generate", True), ("generate_nocache", False)):
                generated = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                           max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                           eos_token_id=None, pad_token_id=0, use_cache=use_cache)
                outputs[f"{name}_{i}"] = generated[0, -args.new_tokens:].float().contiguous()
    save_file(outputs, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
