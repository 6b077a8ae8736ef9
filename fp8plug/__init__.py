"""fp8plug: one FP8 training plugin for PyTorch and Accelerate, whichever engine is installed.

`import fp8plug` imports no FP8 engine; they load when selected. The Accelerator subclass, export_model and the
torchao/OLMo-core shaped entry points (fp8plug.float8) load on first use.
"""

from .autocast import apply_fp8_autowrap, contextual_fp8_autocast, remove_fp8_autowrap
from .api import convert_model, has_fp8_layers, has_transformer_engine_layers, sync_fp8_scaling, unconvert_model
from .backends import BackendUnavailableError, get_backend, select_backend
from .convert import ConversionError, ConversionReport
from .coverage import fp8_coverage
from .recipe import FP8RecipeKwargs

__version__ = "0.1.0"

_LAZY = {"Accelerator": "fp8plug.accelerator", "float8": "fp8plug.float8", "export_model": "fp8plug.export"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module = importlib.import_module(_LAZY[name])
        return module if name == "float8" else getattr(module, name)
    raise AttributeError(f"module 'fp8plug' has no attribute {name!r}")


__all__ = [
    "Accelerator",
    "BackendUnavailableError",
    "ConversionError",
    "ConversionReport",
    "FP8RecipeKwargs",
    "apply_fp8_autowrap",
    "contextual_fp8_autocast",
    "convert_model",
    "export_model",
    "float8",
    "fp8_coverage",
    "get_backend",
    "has_fp8_layers",
    "has_transformer_engine_layers",
    "remove_fp8_autowrap",
    "select_backend",
    "sync_fp8_scaling",
    "unconvert_model",
]
