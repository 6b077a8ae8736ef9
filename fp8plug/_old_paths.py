"""The import paths fp8plug had before its modules moved into folders, kept working.

`import fp8plug.export` (or `.transformers`, `.float8`, ...) gives the module that now lives in a
folder (`fp8plug.checkpoints.export`): the same module object, imported only when asked for, so
user code and pickles that name an old path keep working without a file per old name.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

OLD_PATHS = {
    "accelerator": "integrations.accelerator",
    "attention": "hf.attention",
    "checkpoint": "checkpoints.state",
    "checkpoint_dir": "checkpoints.directory",
    "convert": "layers.rules",
    "cpu_processes": "integrations.cpu_processes",
    "ddp_buffers": "layers.ddp_buffers",
    "deepspeed": "integrations.deepspeed_zero",
    "export": "checkpoints.export",
    "float8": "integrations.float8",
    "float8_training": "integrations.float8_training",
    "fp8_attention": "hf.fp8_attention",
    "fp8_gemm": "backends.gemm",
    "fused_heads": "layers.fused_heads",
    "gemm_counts": "layers.gemm_counts",
    "hardware": "tuning.hardware",
    "launch": "integrations.launch",
    "launch_env": "integrations.launch_env",
    "models": "bench.toy_model",
    "optim": "integrations.optim",
    "plans": "recipe.plans",
    "recipe_env": "recipe.environment",
    "resume": "checkpoints.resume",
    "roofline": "tuning.roofline",
    "roofline_fit": "tuning.roofline_fit",
    "scaling": "backends.native.scaling",
    "steps": "backends.steps",
    "torchao_config": "backends.ao.config",
    "transformers": "integrations.trainer",
}


class _OldPathFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `fp8plug.<old name>` and hands back the module at its new path."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.rpartition(".")
        if package == "fp8plug" and name in OLD_PATHS:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return importlib.import_module("fp8plug." + OLD_PATHS[spec.name.rpartition(".")[2]])

    def exec_module(self, module):
        pass  # the module at the new path is already imported


def install_old_paths() -> None:
    """Put the finder on `sys.meta_path` once per process."""
    if not any(isinstance(finder, _OldPathFinder) for finder in sys.meta_path):
        sys.meta_path.append(_OldPathFinder())
