"""What the reference scripts share: the exit status that says a package is missing (the C++ test
then skips), and the model ours is held to, loaded as transformers loads a checkpoint for these
comparisons (CPU, fp32, eager attention)."""
import argparse
import sys

MISSING_PACKAGE = 3


def missing(error: ImportError) -> int:
    print(f"missing Python package: {error}", file=sys.stderr)
    return MISSING_PACKAGE


def reference_parser(description: str) -> argparse.ArgumentParser:
    """The arguments every reference script takes: the checkpoint, the inputs and the output file."""
    parser = argparse.ArgumentParser(description=description)
    for name in ("--checkpoint", "--inputs", "--output"):
        parser.add_argument(name, required=True)
    return parser


def inputs_and_model(args):
    """The tensors of --inputs and the reference model of --checkpoint."""
    from safetensors.torch import load_file

    return load_file(args.inputs), reference_model(args.checkpoint)


def reference_model(checkpoint: str):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32, attn_implementation="eager"
    )
