"""PEFT's own merge refused on an FP8-stored base, in one line that names the merge that works.

Why: PEFT merges a LoRA adapter by adding its delta to the base weight in place
(`base_layer.weight.data += delta`). A `load_fp8_base` layer's weight is float8 codes with a
separate scale, so torch stops with "Promotion for Float8 Types is not supported", which names
neither the layer nor the fix, and a `merge_and_unload()` that got that far has already merged the
adapters of the layers before it. `fp8plug.merge_and_export` does the merge in FP8 (layer by layer:
dequantized, delta added, quantized again) and `fp8plug.export_model(model).merge_and_unload()` in
high precision; the refusal names both.

How: torch calls its global module-registration hooks whenever a module is set as another's child.
PEFT sets the base model as its tuner's `model` and each base layer as its LoRA layer's
`base_layer`; for a model `load_fp8_base` loaded (`FP8_BASE`) and for each frozen FP8 layer, the
hook gives the tuner's `merge_and_unload` / `merge_adapter` and the LoRA layer's `merge` a guard,
as instance attributes, which asks at call time whether an FP8 base layer is still there (after
`export_model` none is, and PEFT merges as usual). The tuner's guard refuses before any layer is
merged. Only public PEFT methods are wrapped; the hook is registered once, by `load_fp8_base`.
"""

from __future__ import annotations

from typing import Optional

from torch import nn
from torch.nn.modules.module import register_module_module_registration_hook

FP8_BASE = "_fp8plug_fp8_base"  # set on a model load_fp8_base loaded (export_model removes it)
TUNER_METHODS = ("merge_and_unload", "merge_adapter")
LAYER_METHODS = ("merge",)
_registered = []


def watch_peft_merges() -> None:
    """Register the module-registration hook that guards PEFT's merges (once per process)."""
    if not _registered:
        _registered.append(register_module_module_registration_hook(_on_registration))


def _on_registration(parent: nn.Module, name: str, child: nn.Module) -> None:
    if name == "model" and child.__dict__.get(FP8_BASE):
        _guard(parent, TUNER_METHODS, _tuner_fp8_layer)
    elif name == "base_layer" and getattr(child, "frozen_fp8", False):
        _guard(parent, LAYER_METHODS, _layer_fp8_base)
    return None


def _guard(owner: nn.Module, methods, find) -> None:
    for method in methods:
        if callable(getattr(type(owner), method, None)) and method not in owner.__dict__:
            owner.__dict__[method] = MergeGuard(owner, method, find)


class MergeGuard:
    """`owner.<method>`, refused while `find(owner)` finds an FP8-stored base layer (a picklable
    callable, so the wrapped module still pickles and deep-copies)."""

    def __init__(self, owner: nn.Module, method: str, find):
        self.owner, self.method, self.find = owner, method, find

    def __call__(self, *args, **kwargs):
        layer = self.find(self.owner)
        if layer is not None:
            raise ValueError(
                f"PEFT's {self.method}() would add the LoRA delta to the float8 codes of {layer}, a base layer "
                "load_fp8_base keeps in FP8; merge with fp8plug.merge_and_export(model, directory) (an FP8 checkpoint) "
                "or fp8plug.export_model(model).merge_and_unload() (high precision).")
        return getattr(type(self.owner), self.method)(self.owner, *args, **kwargs)


def _tuner_fp8_layer(tuner: nn.Module) -> Optional[str]:
    model = getattr(tuner, "model", None)
    if model is None:
        return None
    return next((repr(name) for name, module in model.named_modules() if getattr(module, "frozen_fp8", False)), None)


def _layer_fp8_base(layer: nn.Module) -> Optional[str]:
    base = layer
    while isinstance(getattr(base, "base_layer", None), nn.Module):
        base = base.base_layer
    if not getattr(base, "frozen_fp8", False):
        return None
    out_features, in_features = base.weight.shape
    return f"the {type(base).__name__} ({in_features} -> {out_features}) under this LoRA layer"
