"""LoRA adapters merged into an FP8 base and written as an FP8 checkpoint again, in one call:
`merge_and_export`.

Why not PEFT's `merge_and_unload()` then `save_fp8_checkpoint`: PEFT would add the adapters'
delta to the float8 codes in place (no scale, no arithmetic in float8), and a merged model would
need every base weight in high precision at once. Here each layer is done on its own: its base
dequantized (fp8 x scale, float32, this layer only), the active adapters' deltas added as PEFT
computes them (`get_delta_weight`: scaling, fan_in_fan_out), the sum quantized in the layout asked
for and moved to the CPU. The in-memory model is not changed, so training can go on.

The checkpoint quantizes exactly the Linears that were FP8 in the source (every `FrozenFP8Linear`
but a head quantized only at load, `fp8_head`, and, in the block layout, those whose width
transformers would read wrong: export_formats.block_width_problem) and keeps the rest as they are, listed in
`quantization_config` as `save_fp8_checkpoint` lists them; the files are written by the same
writer (fp8plug.checkpoints.export_formats, the directory swapped in whole by export_dir).
"""

from __future__ import annotations

import logging
import os
import re
import sys
from typing import Dict, Tuple

import torch
from torch import nn

from fp8plug.checkpoints import export_experts
from fp8plug.checkpoints import export_formats as formats
from fp8plug.checkpoints.export import FP8CheckpointReport
from fp8plug.checkpoints.export_dir import replacing

logger = logging.getLogger("fp8plug")

_ADAPTER_KEY = re.compile(r"\.(lora_[A-Za-z_]+|original_module)\.")


def merge_and_export(model: nn.Module, directory, *, layout: str = "block",
                     max_shard_size="5GB") -> FP8CheckpointReport:
    """Write `model` (a PEFT model over a `fp8plug.load_fp8_base` model, or that model itself)
    with its active LoRA adapters merged to `directory` as an FP8 checkpoint in `layout` ("block"
    or "per_tensor", as `save_fp8_checkpoint`), one layer at a time; the model is left as it was.
    The result loads with `load_fp8_base` and transformers' `from_pretrained`."""
    layout = formats.check_layout(layout)
    inner = _base_model(model)
    state = inner.state_dict(keep_vars=True)
    frozen = {n: m for n, m in inner.named_modules() if getattr(m, "frozen_fp8", False)}
    if not frozen:
        raise ValueError(f"merge_and_export: {type(inner).__name__} has no FP8 base layers (it was not loaded with "
                         "fp8plug.load_fp8_base); for a high-precision model use "
                         "save_fp8_checkpoint(fp8plug.export_model(model).merge_and_unload(), directory).")
    deltas = _adapter_deltas(inner)
    scale_name = formats.SCALE_NAMES[layout]
    report = FP8CheckpointReport(os.fspath(directory), layout)
    tensors: Dict[str, torch.Tensor] = {}
    seen = set()
    for key, tensor in state.items():
        name = _plain_key(key)
        if name is None or name.endswith(".weight_scale"):
            continue
        if tensor.numel() and tensor.data_ptr() in seen:  # a tied weight: stored once, under its first name
            continue
        seen.add(tensor.data_ptr())
        stem = name[: -len(".weight")] if name.endswith(".weight") else None
        holder = frozen.get(_module_key(key))
        if holder is not None and key.endswith(".weight"):
            weight = holder.dequantized_weight(torch.float32)
            for delta in deltas.get(stem, ()):
                weight = weight + delta.float()
            too_wide = formats.block_width_problem(*weight.shape) if layout == "block" else None
            if getattr(holder, "quantized_at_load", False):  # the source kept it in high precision
                report.kept[stem] = "kept in high precision by the source checkpoint (quantized only at load)"
                tensors[name] = weight.to(holder.compute_dtype).cpu()
            elif too_wide:  # as save_fp8_checkpoint keeps it: transformers would read its tiles wrong
                report.kept[stem] = too_wide
                tensors[name] = weight.to(holder.compute_dtype).cpu()
            else:
                report.quantized.append(stem)
                fp8, scale = formats.quantize(weight, layout)
                tensors[name], tensors[f"{stem}.{scale_name}"] = fp8.cpu(), scale.cpu()
            del weight
            continue
        value = tensor.detach()
        if stem in deltas:  # LoRA on a high-precision weight (an embedding, say)
            value = (value.float() + sum(d.float() for d in deltas[stem])).to(tensor.dtype)
        tensors[name] = value.cpu()
    for stem, why in _kept_linears(inner, frozen).items():
        report.kept.setdefault(stem, why)
    # MoE experts (high precision in memory): FP8 per expert, as the source
    tensors, _ = export_experts.add_to_checkpoint(inner, report, tensors, layout)
    entry = formats.model_config(inner)
    entry["dtype"] = str(next(m.compute_dtype for m in frozen.values())).rpartition(".")[2]
    entry["quantization_config"] = formats.quantization_config(
        layout, export_experts.module_checkpoint_names(inner, report.kept))
    with replacing(directory) as work:
        report.files = formats.write_weights(tensors, work, max_shard_size)
        formats.write_json(os.path.join(work, "config.json"), entry)
        report.files.append("config.json")
        generation = getattr(inner, "generation_config", None)
        if generation is not None and callable(getattr(inner, "can_generate", None)) and inner.can_generate():
            generation.save_pretrained(work)
            report.files.append("generation_config.json")
    logger.info("fp8plug: merged %d adapted layers; %s", len(deltas), report)
    return report


def _base_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT model (or `model` itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _plain_key(key: str):
    """The checkpoint key of state-dict `key` (PEFT's `base_layer.` and `modules_to_save.<name>.`
    removed), or None for an adapter's own tensor."""
    if _ADAPTER_KEY.search(key):
        return None
    key = key.replace(".base_layer.", ".")
    return re.sub(r"\.modules_to_save\.[^.]+\.", ".", key)


def _module_key(key: str) -> str:
    return key.rpartition(".")[0]


def _kept_linears(model: nn.Module, frozen: Dict[str, nn.Module]) -> Dict[str, str]:
    """checkpoint name -> why, for each Linear of the model that is not an FP8 base layer (the
    source checkpoint kept it in high precision; a tied head among them)."""
    kept, first = {}, {}
    for name, module in model.named_modules(remove_duplicate=False):
        if not isinstance(module, nn.Linear) or name in frozen:
            continue
        plain = _plain_key(f"{name}.weight")
        if plain is None:  # an adapter's own lora_A / lora_B
            continue
        stem = plain[: -len(".weight")]
        owner = first.setdefault(module.weight.data_ptr(), stem)
        tied = f" (tied to {owner})" if owner != stem else ""
        kept[stem] = "kept in high precision by the source checkpoint" + tied
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and embedding is not None and head.weight is embedding.weight:
        name = next(n for n, m in model.named_modules() if m is head)
        kept[_plain_key(f"{name}.weight")[: -len(".weight")]] = "tied to the input embedding"
    return kept


def _adapter_deltas(model: nn.Module) -> Dict[str, Tuple[torch.Tensor, ...]]:
    """checkpoint module name -> the deltas of its active, unmerged LoRA adapters (PEFT's own
    `get_delta_weight`, scaling and fan_in_fan_out included); refuses what it cannot merge."""
    peft = sys.modules.get("peft")
    if peft is None:
        return {}
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer

    deltas = {}
    for name, module in model.named_modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        if not isinstance(module, LoraLayer):
            raise ValueError(f"merge_and_export: {name} is a {type(module).__name__}; only LoRA adapters are merged.")
        if getattr(module, "merged", False):
            raise ValueError(f"merge_and_export: {name} has adapters merged already (merge_adapter()); call "
                             "unmerge_adapter() first: merge_and_export merges them itself.")
        embeddings = getattr(module, "lora_embedding_A", {})
        active = [a for a in module.active_adapters if a in module.lora_A or a in embeddings]
        for adapter in active:
            if getattr(module, "use_dora", {}).get(adapter, False):
                raise ValueError(f"merge_and_export: {name} uses DoRA (adapter {adapter!r}), whose merge rescales the "
                                 "base weight's columns; merge it in high precision instead.")
        if active:
            deltas[name] = tuple(module.get_delta_weight(adapter).detach() for adapter in active)
    return deltas
