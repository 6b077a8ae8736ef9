"""fp8plug: one FP8 training plugin for PyTorch and Accelerate, whichever engine is installed.

`import fp8plug` imports no FP8 engine; they load when selected. The Accelerator subclass, export_model and the
torchao/OLMo-core shaped entry points (fp8plug.integrations.float8) load on first use.
"""

from fp8plug._old_paths import install_old_paths
from fp8plug.autocast import apply_fp8_autowrap, contextual_fp8_autocast, remove_fp8_autowrap
from fp8plug.api import (
    convert_model,
    has_fp8_layers,
    has_transformer_engine_layers,
    sync_fp8_scaling,
    unconvert_model,
)
from fp8plug.backends import BackendUnavailableError, get_backend, select_backend
from fp8plug.layers.rules import ConversionError, ConversionReport
from fp8plug.coverage import fp8_coverage
from fp8plug.recipe.kwargs import FP8RecipeKwargs

__version__ = "0.1.0"

_LAZY = {"Accelerator": "fp8plug.integrations.accelerator", "float8": "fp8plug.integrations.float8",
         "export_model": "fp8plug.checkpoints.export"}
install_old_paths()


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
