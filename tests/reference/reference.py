"""What the reference scripts share: the exit status that says a package is missing (the C++ test
then skips), and the model ours is held to, loaded as transformers loads a checkpoint for these
comparisons (CPU, fp32, eager attention)."""
import sys

MISSING_PACKAGE = 3


def missing(error: ImportError) -> int:
    print(f"missing Python package: {error}", file=sys.stderr)
    return MISSING_PACKAGE


def reference_model(checkpoint: str):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32, attn_implementation="eager"
    )
