"""python -m symbiosis.serve: symbiosis-serve."""
import sys

from .cli import main

if __name__ == "__main__":  # not again in a process that multiprocessing spawns
    sys.exit(main())
