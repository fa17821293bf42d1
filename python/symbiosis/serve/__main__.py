"""python -m symbiosis.serve: symbiosis-serve."""
import sys

from .cli import main

sys.exit(main())
