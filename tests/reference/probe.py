#!/usr/bin/env python3
"""probe.py MODULE...: exits 0 when every module imports, 3 (reference.MISSING_PACKAGE) naming the
first that does not."""
import importlib
import sys

from reference import missing

if __name__ == "__main__":
    try:
        for name in sys.argv[1:]:
            importlib.import_module(name)
    except ImportError as error:
        sys.exit(missing(error))
