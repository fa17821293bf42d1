#!/usr/bin/env python3
"""Hugging Face PEFT's side of the adapter-file interop tests (CPU, fp32).

  peft_interop.py run  --checkpoint DIR --adapter ADAPTER --inputs IN --output OUT
      Loads the base model (transformers, eager attention) and the adapter with
      PeftModel.from_pretrained, and writes the logits of IN's input_ids/attention_mask.
  peft_interop.py make --checkpoint DIR --method M --adapter ADAPTER --inputs IN --output OUT
      Creates a PEFT adapter of method M with non-trivial random weights, writes the logits it gives,
      and saves it with save_pretrained to ADAPTER.

Prompt-learning methods return logits for the virtual tokens too; only the last T positions (the
real tokens') are written, as the C++ models return them. IN holds "input_ids" and optionally
"attention_mask" (any dtype); OUT holds "logits" [B,T,V] fp32.
Exit status 3 when a Python package is missing (the C++ test then skips).
"""
import sys

from reference import inputs_and_model, missing, reference_parser


# Each architecture's attention layers, and an MLP layer, as the C++ tests name them.
ATTENTION = {"gpt2": ["c_attn"], "gpt_bigcode": ["c_attn"], "gpt_neox": ["query_key_value"], "phi3": ["qkv_proj"]}
MLP = {"gpt2": ["c_fc"], "gpt_bigcode": ["c_fc"], "gpt_neox": ["dense_4h_to_h"], "opt": ["fc2"], "phi": ["fc2"]}


def make_config(peft, method, model_type):
    attention = ATTENTION.get(model_type, ["q_proj", "v_proj"])
    if method == "lora":
        return peft.LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules=attention,
                               init_lora_weights=False)
    if method == "lora_rslora_patterns":
        return peft.LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules="all-linear",
                               use_rslora=True, init_lora_weights=False,
                               rank_pattern={"v_proj": 2, "c_fc": 6},
                               alpha_pattern={r"layers\.1\.mlp\.down_proj": 3, r"h\.0\.attn\.c_attn": 5})
    if method == "lora_dora":
        mlp = MLP.get(model_type, ["down_proj"])
        return peft.LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules=attention + mlp,
                               use_dora=True, init_lora_weights=False)
    if method == "adalora":
        return peft.AdaLoraConfig(task_type="CAUSAL_LM", init_r=6, target_r=2, lora_alpha=8, target_modules=attention,
                                  init_lora_weights=False, total_step=2)
    if method == "ia3":
        if model_type == "phi3":  # PEFT has no default IA3 targets for it
            return peft.IA3Config(task_type="CAUSAL_LM", init_ia3_weights=False, target_modules=["qkv_proj", "down_proj"],
                                  feedforward_modules=["down_proj"])
        return peft.IA3Config(task_type="CAUSAL_LM", init_ia3_weights=False)
    if method == "prompt_tuning":
        return peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=5)
    if method == "p_tuning":
        return peft.PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=4, encoder_hidden_size=32)
    if method == "prefix_tuning":
        return peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=6)
    if method == "prefix_tuning_projection":
        return peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3, prefix_projection=True,
                                       encoder_hidden_size=24)
    raise SystemExit(f"unknown method {method}")


def main() -> int:
    parser = reference_parser(__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["run", "make"])
    parser.add_argument("--adapter", required=True)
    parser.add_argument("--method")
    args = parser.parse_args()
    try:
        import torch
        import transformers  # noqa: F401 (reference_model loads with it)
        import peft
        from safetensors.torch import save_file
    except ImportError as e:
        return missing(e)

    inputs, base = inputs_and_model(args)
    if args.mode == "run":
        model = peft.PeftModel.from_pretrained(base, args.adapter)
    else:
        torch.manual_seed(99)
        model = peft.get_peft_model(base, make_config(peft, args.method, base.config.model_type))
        with torch.no_grad():
            for name, p in model.named_parameters():
                # DoRA's magnitude starts at the weight norm, where DoRA equals LoRA; move it off.
                if "lora_magnitude_vector" in name:
                    p.mul_(torch.rand_like(p) + 0.5)
        if args.method == "adalora":
            # One training step and a budgeted allocation (step 1 of 2), so the saved adapter carries a
            # rank_pattern and holds only the kept triplets.
            ids = torch.randint(0, 200, (2, 7), generator=torch.Generator().manual_seed(77))
            model(input_ids=ids, labels=ids).loss.backward()
            model.base_model.update_and_allocate(1)
            model.zero_grad()
    model.eval()
    kwargs = {k: inputs[k].long() for k in ("input_ids", "attention_mask") if k in inputs}
    with torch.no_grad():
        logits = model(**kwargs).logits
    length = kwargs["input_ids"].shape[1]
    save_file({"logits": logits[:, -length:].float().contiguous()}, args.output)
    if args.mode == "make":
        model.save_pretrained(args.adapter)
    return 0


if __name__ == "__main__":
    sys.exit(main())
