"""Private helper of the te engine (fp8plug/backends/te/engine.py): importing TransformerEngine.

TE's API under its old and new names (`TEApi`), the import itself (`te`), its version, its
global FP8 state manager, and the cuDNN preloading that must happen before TE is first imported
(`share_torch_cudnn`). Imported by the te engine, its other helpers and FP8 attention
(te/attention.py) only.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from typing import Any, Optional

import torch

TE_MODULE = "transformer_engine.pytorch"


@dataclass(frozen=True)
class TEApi:
    """TE's autocast under whichever name the installed version has: `autocast(enabled, recipe,
    amax_reduction_group)` (TE >= 2.8, which also has `quantized_model_init`), or
    `fp8_autocast(enabled, fp8_recipe, fp8_group)` (older, deprecated since)."""

    module: Any

    @property
    def new_names(self) -> bool:
        return callable(getattr(self.module, "autocast", None)) and hasattr(self.module, "quantized_model_init")

    def autocast(self, enabled: bool = True, recipe=None, group=None):
        if self.new_names:
            return self.module.autocast(enabled=enabled, recipe=recipe, amax_reduction_group=group)
        return self.module.fp8_autocast(enabled=enabled, fp8_recipe=recipe, fp8_group=group)



def import_te():
    """transformer_engine.pytorch, imported now (only ever called once the engine is in use)."""
    share_torch_cudnn()
    return importlib.import_module(TE_MODULE)


def torch_cudnn_dir() -> Optional[str]:
    """The folder of the cuDNN that torch ships with (the nvidia-cudnn wheel), or None."""
    import glob
    import importlib.util
    import os

    try:
        spec = importlib.util.find_spec("nvidia.cudnn")
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if glob.glob(os.path.join(folder, "**", "libcudnn.so*"), recursive=True):
            return folder
    return None


def share_torch_cudnn() -> Optional[str]:
    """Make TransformerEngine use the cuDNN torch uses; returns that folder if it acted.

    At import TE loads cuDNN itself (RTLD_GLOBAL), from CUDNN_HOME, CUDNN_PATH, CUDA_HOME or the
    system library path before any Python wheel, and the loader takes the cuDNN sub-libraries its
    libraries depend on from the system unless torch loaded them first; so a system cuDNN other than
    torch's ends up in the process beside it (what that cost on an H200: docs/te.md). So, before TE
    is imported, every library of torch's cuDNN is loaded (as torch's own preloading does) and
    CUDNN_PATH points at it: each later lookup finds the copy already loaded.
    A CUDNN_PATH or CUDNN_HOME the user set is left alone, and so is a machine without the wheel or
    without a GPU. Once TE is imported it is too late, and this does nothing.
    """
    import ctypes
    import glob
    import os

    if TE_MODULE in sys.modules or os.environ.get("CUDNN_PATH") or os.environ.get("CUDNN_HOME"):
        return None
    if not torch.cuda.is_available():
        return None
    folder = torch_cudnn_dir()
    if folder is None:
        return None
    libraries = sorted(glob.glob(os.path.join(folder, "lib", "libcudnn*.so.*[0-9]")))
    # the dispatcher and the graph library first: the others link against them
    libraries.sort(key=lambda path: (not os.path.basename(path).startswith(("libcudnn.so", "libcudnn_graph")), path))
    for library in libraries:
        try:
            ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            return None  # a broken wheel: leave cuDNN to TE and torch as they are
    os.environ["CUDNN_PATH"] = folder
    return folder


def te_version() -> str:
    try:
        return str(importlib.import_module("transformer_engine").__version__)
    except Exception:  # noqa: BLE001
        return "?"


def state_manager():
    try:
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager
    except ImportError:  # TE < 2.8
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
    return FP8GlobalStateManager
