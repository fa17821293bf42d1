"""Symbiosis for Python tenants: virtualize a transformers model's base layers onto a shared base
executor through the C++ client runtime (docs/python.md).

    import symbiosis
    client = symbiosis.Client.connect("tcp://127.0.0.1:5555", tenant="alice")
    symbiosis.virtualize(model, client)   # every served Linear / Conv1D now runs on the executor
"""
import pkgutil

# The package's Python sources (python/symbiosis/) and its extension module (built by CMake into
# build/python/symbiosis/) lie in two folders; with both on sys.path this joins them.
__path__ = pkgutil.extend_path(__path__, __name__)

import torch  # noqa: E402  (loads LibTorch before the extension, which links it)

try:
    from . import _C  # noqa: E402
except ImportError as error:  # pragma: no cover - says what is missing instead of a bare import error
    raise ImportError(
        "symbiosis: the extension module symbiosis._C is not built or not on sys.path "
        "(build the target symbiosis_python_extension and put build/python on PYTHONPATH, or run "
        f"make build and use build/venv/bin/python, the build's own environment): {error}"
    ) from error

from .client import Client, Error, LayerInfo, ResultsLost, model_hash  # noqa: E402
from .generation import Generation, Generator  # noqa: E402
from .virtual import BaseWeightStandIn, VirtualConv1D, VirtualLinear, is_virtual, virtualize  # noqa: E402
from .weights import empty_parameters, from_pretrained, load_weights  # noqa: E402

__all__ = [
    "BaseWeightStandIn",
    "Client",
    "Error",
    "Generation",
    "Generator",
    "LayerInfo",
    "ResultsLost",
    "VirtualConv1D",
    "VirtualLinear",
    "empty_parameters",
    "from_pretrained",
    "is_virtual",
    "load_weights",
    "model_hash",
    "virtualize",
]
