#!/usr/bin/env python3
"""peft_auto_load.py --adapter DIR: loads DIR with PEFT's AutoPeftModelForCausalLM, which finds the
base model from the adapter's base_model_name_or_path alone, and prints what it loaded.
Exit status 3 when a Python package is missing (the C++ test then skips)."""
import argparse
import sys

from reference import missing


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapter", required=True)
    args = parser.parse_args()
    try:
        import peft
    except ImportError as error:
        return missing(error)
    model = peft.AutoPeftModelForCausalLM.from_pretrained(args.adapter)
    print(type(model.get_base_model()).__name__, model.peft_config["default"].base_model_name_or_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
