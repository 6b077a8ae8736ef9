"""Handing a model trained in FP8 on: plain torch modules in one call, and an FP8 checkpoint that
inference servers load.

Why a separate step: during training the Linears are an engine's FP8 modules and the forward is
wrapped by fp8plug's autocast; a model to ship (PEFT's `merge_and_unload()`, `save_pretrained`,
`torch.export`) wants plain `nn.Linear`s and no wrapper. `export_model` does both, whichever
engine converted the model.

The FP8 checkpoint (`save_fp8_checkpoint`) is the per-tensor layout vLLM and SGLang read for
`quant_method: "fp8"`: every exported Linear's weight in float8_e4m3fn with a float32
`<name>.weight_scale` beside it (weight = fp8 value x weight_scale), activations scaled
dynamically by the server (`activation_scheme: "dynamic"`), the layers kept in high precision
listed under `ignored_layers`, and everything else in its trained dtype. The weight scales come
from the final weights' own amax (max |w| / 448), not from the training run's scaling state: that
was set from the weights of the step before, and delayed recipes leave a margin; the weights'
own amax gives the smallest quantization error for the weights actually shipped.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional

import torch
from accelerate.utils import extract_model_from_parallel
from torch import nn

from fp8plug.api import loaded_engines, unconvert_model
from fp8plug.autocast import remove_fp8_autowrap
from fp8plug.layers.rules import linear_alignment_problem

logger = logging.getLogger("fp8plug")

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
WEIGHTS_NAME = "model.safetensors"


def export_model(model: nn.Module) -> nn.Module:
    """`model` with plain torch modules only, in place: fp8plug's FP8 forward wrapper removed and
    every engine's FP8 modules swapped back for torch modules with the same (trained) weights.
    Accepts what `Accelerator.unwrap_model` returns, a torch.compile'd model, or a PEFT model
    (then `merge_and_unload()` gives plain Linears with the adapters merged)."""
    inner = extract_model_from_parallel(model)  # DDP, DeepSpeed and torch.compile wrappers off
    # accelerate's mixed-precision forward (kept by unwrap_model's default) sits outside fp8plug's
    if inner.__dict__.pop("_original_forward", None) is not None:
        inner.__dict__.pop("forward", None)
    remove_fp8_autowrap(inner)
    unconvert_model(inner)
    return inner


@dataclass
class FP8CheckpointReport:
    """What `save_fp8_checkpoint` wrote: the directory, the Linears stored in FP8 and those kept."""

    directory: str
    quantized: List[str] = field(default_factory=list)
    kept: Dict[str, str] = field(default_factory=dict)  # name -> why not in FP8

    def __str__(self) -> str:
        kept = ", ".join(f"{n} ({why})" for n, why in self.kept.items()) or "none"
        return (f"FP8 checkpoint in {self.directory}: {len(self.quantized)} Linear weights in float8_e4m3fn "
                f"with per-tensor scales; kept in high precision: {kept}")


def quantize_weight(weight: torch.Tensor):
    """(weight in float8_e4m3fn, float32 scale) with weight ~= fp8 * scale, per tensor."""
    w = weight.detach().float()
    amax = w.abs().max()
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    return (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale.reshape(())


def save_fp8_checkpoint(model: nn.Module, directory: str, *,
                        modules_to_ignore: Iterable[str] = ("lm_head",)) -> FP8CheckpointReport:
    """Write `model` (a transformers PreTrainedModel, trained with any engine or none) to
    `directory` as an FP8 inference checkpoint: config.json with its `quantization_config`, and
    model.safetensors (module docstring). The model is not changed. Linears whose name ends with
    an entry of `modules_to_ignore`, or whose width is not a multiple of 16 (what FP8 GEMMs
    need), stay in their trained dtype and are listed in `ignored_layers`."""
    from safetensors.torch import save_file

    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise TypeError(
            f"save_fp8_checkpoint: expected a transformers PreTrainedModel (it writes the model's config "
            f"with the quantization entry), got {type(model).__name__}; for other models use "
            "fp8plug.checkpoints.export.quantize_weight per Linear.")
    inner = getattr(model, "_orig_mod", model)
    ignore = tuple(modules_to_ignore)
    report = FP8CheckpointReport(os.fspath(directory))
    tensors: Dict[str, torch.Tensor] = {}
    stored: Dict[int, str] = {}  # data_ptr -> the name it was stored under
    linears = {name: m for name, m in inner.named_modules() if isinstance(m, nn.Linear)}
    for name, tensor in _plain_weights(inner).items():
        module_name, _, leaf = name.rpartition(".")
        module = linears.get(module_name)
        if tensor.data_ptr() in stored and tensor.numel() > 0:  # tied: stored once, re-tied by the config
            if module is not None and leaf == "weight":
                report.kept[module_name] = f"tied to {stored[tensor.data_ptr()]}"
            continue
        stored[tensor.data_ptr()] = name
        if module is None or leaf != "weight":
            tensors[name] = tensor.detach().contiguous()
            continue
        why = _kept_reason(module_name, module, ignore)
        if why:
            report.kept[module_name] = why
            tensors[name] = tensor.detach().contiguous()
            continue
        fp8, scale = quantize_weight(tensor)
        tensors[name], tensors[f"{module_name}.weight_scale"] = fp8, scale
        report.quantized.append(module_name)
    os.makedirs(directory, exist_ok=True)
    save_file({k: v.cpu() for k, v in tensors.items()}, os.path.join(directory, WEIGHTS_NAME),
              metadata={"format": "pt"})
    entry = config.to_dict()
    entry["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                    "ignored_layers": sorted(report.kept)}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(entry, f, indent=2, sort_keys=True)
    logger.info("fp8plug: %s", report)
    return report


def load_fp8_checkpoint(directory: str) -> Dict[str, torch.Tensor]:
    """The state dict of a `save_fp8_checkpoint` directory with every FP8 weight dequantized to
    float32 (fp8 x weight_scale) and the scales dropped: what loads into the plain architecture,
    to check the checkpoint without an inference server."""
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(directory, WEIGHTS_NAME))
    state = {}
    for name, tensor in tensors.items():
        if name.endswith(".weight_scale"):
            continue
        scale = tensors.get(name[: -len("weight")] + "weight_scale") if name.endswith(".weight") else None
        state[name] = tensor.float() * scale if scale is not None else tensor
    return state


def _kept_reason(name: str, module: nn.Linear, ignore) -> Optional[str]:
    if any(name == entry or name.endswith("." + entry) for entry in ignore):
        return "listed in modules_to_ignore"
    return linear_alignment_problem(module)  # the conversion's own shape rule


def _plain_weights(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The model's state dict with the plain architecture's keys (every engine's entries dropped)."""
    state = model.state_dict()
    for engine in loaded_engines():
        state = engine.plain_state_dict(state)
    return state
