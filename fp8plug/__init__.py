"""fp8plug: one FP8 training plugin for PyTorch and Accelerate, whichever engine is installed.

`import fp8plug` imports no FP8 engine (they load when selected), nor torch: every public name,
the Accelerator subclass, export_model and the torchao/OLMo-core shaped entry points
(fp8plug.float8) included, loads on first use.
"""

from fp8plug._old_paths import install_old_paths

__version__ = "0.1.0"

# Every public name, with the module it lives in. They load on first use (PEP 562), so that
# `import fp8plug` imports neither torch nor accelerate: `fp8plug --help` and the other CLI paths
# that need neither answer at once (fp8plug.cli), and `from fp8plug import convert_model` works
# as before.
_LAZY = {
    "Accelerator": "integrations.accelerator",
    "BackendUnavailableError": "backends",
    "ConversionError": "layers.rules",
    "ConversionReport": "layers.rules",
    "FP8RecipeKwargs": "recipe.kwargs",
    "TERecipeKwargs": "recipe.kwargs",
    "apply_fp8_autowrap": "autocast",
    "contextual_fp8_autocast": "autocast",
    "convert_model": "api",
    "export_model": "checkpoints.export",
    "fp8_coverage": "coverage",
    "get_backend": "backends",
    "has_fp8_layers": "api",
    "has_transformer_engine_layers": "api",
    "load_fp8_base": "checkpoints.fp8_base",
    "merge_and_export": "checkpoints.fp8_merge",
    "remove_fp8_autowrap": "autocast",
    "select_backend": "backends",
    "sync_fp8_scaling": "api",
    "unconvert_model": "api",
}
install_old_paths()  # `import fp8plug.export`, `fp8plug.float8`, ... : the flat layout's paths


def __getattr__(name):
    """A public name (or a submodule, as `fp8plug.roofline`), imported on first use."""
    import importlib

    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    elif not name.startswith("_"):
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module 'fp8plug' has no attribute {name!r}") from None
    else:
        raise AttributeError(f"module 'fp8plug' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "Accelerator",
    "BackendUnavailableError",
    "ConversionError",
    "ConversionReport",
    "FP8RecipeKwargs",
    "TERecipeKwargs",
    "apply_fp8_autowrap",
    "contextual_fp8_autocast",
    "convert_model",
    "export_model",
    "float8",
    "fp8_coverage",
    "get_backend",
    "has_fp8_layers",
    "has_transformer_engine_layers",
    "load_fp8_base",
    "merge_and_export",
    "remove_fp8_autowrap",
    "select_backend",
    "sync_fp8_scaling",
    "unconvert_model",
]
