"""The FP8 checkpoint's layout and the files that hold it.

Per tensor: every quantized Linear's weight in float8_e4m3fn with a float32 scalar
`<linear>.weight_scale` beside it (weight ~= fp8 x weight_scale), activations quantized by the
server at run time (`activation_scheme: "dynamic"`), the Linears kept in high precision under
`ignored_layers`: what vLLM and SGLang read for `quant_method: "fp8"`.
"""

from __future__ import annotations

import json
import os
from typing import Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
WEIGHTS_NAME = "model.safetensors"

# vLLM and SGLang run these sibling Linears as one fused layer, in one precision.
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def quantize_per_tensor(weight: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(weight in float8_e4m3fn, float32 scalar scale) with weight ~= fp8 * scale."""
    w = weight.detach().float()
    amax = w.abs().max()
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    return (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale.reshape(())


def dequantize(fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return fp8.float() * scale.float()


def quantization_config(kept: Iterable[str]) -> dict:
    """config.json's `quantization_config`, with the Linears `kept` in high precision."""
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": sorted(kept)}


def fused_siblings(names: Iterable[str]) -> Dict[str, List[str]]:
    """name -> the other Linears (among `names`) it is fused with in vLLM and SGLang."""
    names = set(names)
    siblings: Dict[str, List[str]] = {}
    for name in names:
        parent, _, leaf = name.rpartition(".")
        for group in FUSED_GROUPS:
            if leaf in group:
                others = [f"{parent}.{o}" if parent else o for o in group if o != leaf]
                siblings[name] = [o for o in others if o in names]
    return siblings


def model_config(model: nn.Module) -> dict:
    """The model's config as `save_pretrained` writes it: the class under `architectures` and the
    weights' dtype under `dtype` (a config built by hand has both null), without changing the model."""
    entry = model.config.to_dict()
    entry["architectures"] = [type(model).__name__]
    entry["dtype"] = str(_dtype(model)).rpartition(".")[2]
    return entry


def _dtype(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.get_default_dtype())


def write_json(path: str, entry: dict) -> None:
    with open(path, "w") as f:
        json.dump(entry, f, indent=2, sort_keys=True)
        f.write("\n")


def write_weights(tensors: Dict[str, torch.Tensor], directory: str) -> List[str]:
    """`tensors` as model.safetensors in `directory`; returns the file names written."""
    from safetensors.torch import save_file

    save_file({n: t.contiguous().cpu() for n, t in tensors.items()}, os.path.join(directory, WEIGHTS_NAME),
              metadata={"format": "pt"})
    return [WEIGHTS_NAME]


def read_weights(directory: str) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(directory, WEIGHTS_NAME))


def scale_of(tensors: Dict[str, torch.Tensor], weight_name: str) -> Optional[torch.Tensor]:
    """The scale stored beside `<linear>.weight`, or None."""
    return tensors.get(weight_name[: -len("weight")] + "weight_scale")
