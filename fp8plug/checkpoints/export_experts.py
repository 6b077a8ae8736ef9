"""MoE experts in an FP8 checkpoint: one FP8 weight per expert and projection, under the per-expert
names transformers' own `save_pretrained` writes (Mixtral `block_sparse_moe.experts.{e}.w1/w2/w3`,
Qwen2/3-MoE, DeepSeek-V3, OLMoE ... `mlp.experts.{e}.gate_proj/up_proj/down_proj`), each with the
scale of the layout asked for (`weight_scale_inv` 128x128 blocks, or a scalar `weight_scale`).

Why this layout and not the model's own 3-D names (`experts.gate_up_proj` [E, 2I, H] with a 3-D
`gate_up_proj_scale_inv`): it is the layout both clients read, as the released FP8 MoE checkpoints
(Qwen3-30B-A3B-FP8, DeepSeek-V3) hold it.
- vLLM's Mixtral and Qwen3-MoE loaders take experts only under per-expert names
  (`FusedMoE.make_expert_params_mapping(ckpt_gate_proj_name="w1"/"gate_proj", ...)` maps
  `experts.{e}.w1.weight_scale_inv` to `w13_weight_scale_inv`; per tensor, `experts.{e}.w1.weight_scale`
  goes to `w13_weight_scale`[e, 0] through `_load_per_tensor_weight_scale`). Fused names are not read.
- transformers 5.17 and 5.24 merge per-expert keys into the fused experts through the model's
  conversion mapping (`MergeModulelist(dim=0)`, `Concatenate(dim=1)`); the same converter also
  catches `...w1.weight_scale_inv` (its pattern is searched, not anchored) and merges the block
  scales into `FP8Experts.gate_up_proj_scale_inv` [E, 2*ceil(I/128), ceil(H/128)] on a GPU; on a
  CPU (no FP8 kernels) its quantizer dequantizes each expert before merging (`Fp8Dequantize`).
  Per-tensor scalars do not stack into FP8Experts' per-tensor [E, 2, 1] scale, and transformers
  names per-tensor scales otherwise: the per-tensor layout's config makes transformers refuse it
  (export_formats.PER_TENSOR_SCALE_FMT); vLLM and SGLang read both. As for Linears, in the block
  layout experts whose per-expert weights have a width above 128 that is not a multiple of 128
  stay in high precision (transformers' dequantizer would read them wrong).
The names are found by running transformers' reverse conversion (`revert_weight_conversion`, what
`save_pretrained` runs) on a small probe, so every model with such a mapping gets its own names,
and the rest of the checkpoint is renamed the same way (Mixtral's router: `block_sparse_moe.gate`).

Kept in high precision, under the names save_pretrained writes, and listed in the config:
experts with biases (GPT-OSS: transformers' FP8Experts asserts `has_bias is False`, vLLM reads
GPT-OSS experts as MXFP4 or unquantized), experts stored [E, in, out], experts transformers has no
per-expert names for (its checkpoint is fused, and neither client reads fused FP8 experts with
fp8plug's scales), and those `modules_to_ignore` names. Routers are not Linears to either client
(transformers converts `nn.Linear`s and `.experts` only; vLLM builds the router with no quant
config): they are written in high precision and not listed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

from fp8plug import _upstream
from fp8plug.checkpoints import export_formats as formats
from fp8plug.hf.experts import experts_modules, is_transposed

logger = logging.getLogger("fp8plug")

_PROBE_ROWS = 12  # divisible by every split count a conversion may use (1, 2, 3, 4, 6)
# two identical columns, not one: transformers 5.17's reverse conversion squeezes a trailing
# dimension of size 1 away (5.24 keeps it)
_PROBE_COLS = 2
SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale")


@dataclass(frozen=True)
class Slot:
    """Where one per-expert checkpoint weight lives in the model: rows [part*R, (part+1)*R) of
    expert `expert` of the 3-D parameter `param` (R = that dim / parts)."""

    param: str
    expert: int
    part: int
    parts: int


@dataclass
class ExpertsPlan:
    """The experts modules of a model and how the checkpoint holds them."""

    layouts: Dict[str, Dict[str, Slot]] = field(default_factory=dict)  # fqn -> checkpoint weight key -> slot
    fp8: List[str] = field(default_factory=list)  # fqns written in FP8
    kept: Dict[str, str] = field(default_factory=dict)  # fqn -> why in high precision


def plan(model: nn.Module, ignore: Iterable[str] = (), layout: str = "block") -> ExpertsPlan:
    """Which experts modules of `model` the checkpoint stores in FP8 in `layout`, and under which
    names (in the block layout, none whose per-expert weights transformers would read wrong:
    export_formats.block_width_problem)."""
    result, ignore = ExpertsPlan(), set(ignore)
    for fqn, module in experts_modules(model):
        layout_slots, why = per_expert_layout(model, fqn, module)
        if layout_slots is not None:
            result.layouts[fqn] = layout_slots
        if why is None and fqn in ignore:
            why = "named in modules_to_ignore"
        if why is None and module.down_proj.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            why = f"expert weights in {module.down_proj.dtype}"
        if why is None and layout == "block" and layout_slots is not None:
            why = next(filter(None, (formats.block_width_problem(*expert_rows(getattr(module, slot.param), slot).shape)
                                     for slot in layout_slots.values())), None)
        if why is None:
            result.fp8.append(fqn)
        else:
            result.kept[fqn] = f"MoE experts: {why}"
    return result


def per_expert_layout(model: nn.Module, fqn: str, module: nn.Module) -> Tuple[Optional[Dict[str, Slot]], Optional[str]]:
    """(checkpoint weight key -> Slot, None) for experts transformers saves per expert, else
    (layout or None, why they stay in high precision). The slots come from transformers' reverse
    conversion run on a probe whose values say which expert and rows each output came from."""
    params = {name: p for name, p in module.named_parameters(recurse=False)}
    biases = [n for n, p in params.items() if p.dim() < 3 or n.endswith("_bias")]
    why = None
    if biases:
        why = (f"biases ({', '.join(biases)}): transformers' FP8Experts takes none (it asserts has_bias is False) "
               "and vLLM reads such experts (GPT-OSS) as MXFP4 or unquantized, never as FP8 weights")
    if is_transposed(module):
        return None, why or "weights stored [E, in, out]; no client reads them per expert in FP8"
    probe, origin = {}, {}
    for index, (name, p) in enumerate(params.items()):
        if p.dim() != 3:
            continue
        experts = p.shape[0]
        base = index * experts * _PROBE_ROWS
        probe[f"{fqn}.{name}"] = torch.arange(base, base + experts * _PROBE_ROWS, dtype=torch.float64).reshape(
            experts, _PROBE_ROWS, 1).expand(experts, _PROBE_ROWS, _PROBE_COLS).contiguous()
        origin[name] = (base, experts)
    out = _revert(model, probe)
    if set(out) == set(probe):
        return None, why or "transformers saves these experts fused (no per-expert names), which no client reads in FP8"
    layout: Dict[str, Slot] = {}
    for key, value in out.items():
        slot = _decode(value, origin)
        if slot is None or not key.endswith(".weight"):
            return None, why or f"transformers' reverse conversion gives {key} an unexpected layout"
        layout[key] = slot
    return layout, why


def _decode(value: torch.Tensor, origin: Dict[str, Tuple[int, int]]) -> Optional[Slot]:
    """The Slot a probe output came from: consecutive rows of one expert of one parameter."""
    if value.dim() != 2 or value.shape[1] != _PROBE_COLS or _PROBE_ROWS % value.shape[0]:
        return None
    first = int(value[0, 0])
    for name, (base, experts) in origin.items():
        if base <= first < base + experts * _PROBE_ROWS:
            expert, row = divmod(first - base, _PROBE_ROWS)
            rows = value.shape[0]
            expected = torch.arange(first, first + rows, dtype=value.dtype).reshape(rows, 1).expand(rows, _PROBE_COLS)
            if row % rows or not torch.equal(value, expected):
                return None
            return Slot(name, expert, row // rows, _PROBE_ROWS // rows)
    return None


def _revert(model: nn.Module, state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """transformers' save-time conversion of `state` (model names -> checkpoint names)."""
    return _upstream.checkpoint_state_names(model, state)


def checkpoint_name(model: nn.Module, key: str, cache: Optional[Dict[str, str]] = None) -> str:
    """The name `save_pretrained` writes the model's `key` under (renamings only; a key a converter
    would merge or split keeps its own name). Scale keys follow their weight's name."""
    if cache is not None and key in cache:
        return cache[key]
    suffix = next((s for s in SCALE_SUFFIXES if key.endswith("." + s)), None)
    if suffix is not None:
        renamed = checkpoint_name(model, key[: -len(suffix)] + "weight", cache)
        name = renamed[: -len("weight")] + suffix if renamed.endswith(".weight") else key
    else:
        marker = torch.empty(0)
        try:
            out = _revert(model, {key: marker})
        except Exception:  # a converter that cannot take the key alone (it merges it with others)
            out = {}
        name = next(iter(out)) if len(out) == 1 and next(iter(out.values())) is marker else key
    if cache is not None:
        cache[key] = name
    return name


def module_checkpoint_names(model: nn.Module, names: Iterable[str]) -> List[str]:
    """Module names as the checkpoint spells them (the quantization_config's lists)."""
    cache: Dict[str, str] = {}
    return sorted(checkpoint_name(model, f"{n}.weight", cache)[: -len(".weight")] for n in names)


def checkpoint_tensors(model: nn.Module, tensors: Dict[str, torch.Tensor], experts: ExpertsPlan,
                       layout: str) -> Dict[str, torch.Tensor]:
    """`tensors` (the model's names; Linears already in FP8) under the checkpoint's names, every
    experts module with a per-expert layout split per expert, quantized where `experts.fp8` says
    (with the same quantizer as the Linears: export_formats.quantize), biases in high precision."""
    split = {f"{fqn}.{slot.param}": fqn for fqn, slots in experts.layouts.items() for slot in slots.values()}
    scale_name = formats.SCALE_NAMES[layout]
    fp8 = set(experts.fp8)
    out: Dict[str, torch.Tensor] = {}
    cache: Dict[str, str] = {}
    for key, tensor in tensors.items():
        if key not in split:
            out[checkpoint_name(model, key, cache)] = tensor
    for fqn, slots in experts.layouts.items():
        module = model.get_submodule(fqn)
        for key, slot in sorted(slots.items()):
            weight = expert_rows(getattr(module, slot.param).detach(), slot)
            if fqn in fp8:
                out[key], out[key[: -len("weight")] + scale_name] = formats.quantize(weight, layout)
            else:
                out[key] = weight.clone()  # a view would share storage with its siblings, which safetensors refuses
    return out


def add_to_checkpoint(model: nn.Module, report, tensors: Dict[str, torch.Tensor], layout: str,
                      ignore: Iterable[str] = ()) -> Tuple[Dict[str, torch.Tensor], ExpertsPlan]:
    """What both FP8 writers (save_fp8_checkpoint, merge_and_export) do for experts: plan them,
    record in `report` which are stored in FP8 (`experts`) and which kept and why (`kept`), and
    return `tensors` under the checkpoint's names with the experts per expert, and the plan."""
    experts = plan(model, ignore, layout)
    report.kept.update(experts.kept)
    report.experts = experts.fp8
    return checkpoint_tensors(model, tensors, experts, layout), experts


def expert_rows(param: torch.Tensor, slot: Slot) -> torch.Tensor:
    rows = param.shape[1] // slot.parts
    return param[slot.expert, slot.part * rows:(slot.part + 1) * rows]


def block_warnings(model: nn.Module, experts: ExpertsPlan) -> List[str]:
    """Why vLLM would refuse the block layout for some FP8 experts: its FP8 MoE needs each expert's
    gate and up output rows (the intermediate size) to be a multiple of 128, and transformers'
    FP8Experts allocates ceil(2I/128) gate_up scale rows where the per-expert scales merge to
    2*ceil(I/128)."""
    problems = []
    for fqn in experts.fp8:
        rows = {s.param: getattr(model.get_submodule(fqn), s.param).shape[1] // s.parts
                for s in experts.layouts[fqn].values()}
        bad = {p: r for p, r in rows.items() if r % formats.BLOCK and p != "down_proj"}
        if bad:
            problems.append(f"{fqn} ({', '.join(f'{p} rows per expert {r}' for p, r in bad.items())})")
    return problems


# reading the layout back ---------------------------------------------------------------------------
def model_names(model: nn.Module, keys: Iterable[str]) -> Tuple[Dict[str, str], Dict[str, Tuple[str, Slot]]]:
    """For a model and a checkpoint's `keys`: (checkpoint key -> the model's key for 1:1 renamed
    tensors, per-expert checkpoint weight key -> (experts fqn, Slot)). Keys in neither are the
    model's own names (an older export, or a model without conversion mapping)."""
    keys = set(keys)
    experts = plan(model)
    slots = {key: (fqn, slot) for fqn, layout in experts.layouts.items() for key, slot in layout.items() if key in keys}
    cache: Dict[str, str] = {}
    renamed = {}
    for key, _ in list(model.named_parameters()) + list(model.named_buffers()):
        name = checkpoint_name(model, key, cache)
        if name != key:
            renamed[name] = key
    return renamed, slots


def assemble_experts(model: nn.Module, slots: Dict[str, Tuple[str, Slot]], read: Callable[[str], torch.Tensor],
                     dtype: torch.dtype, device) -> Dict[str, torch.Tensor]:
    """Each 3-D expert parameter `slots` names ("<fqn>.<param>" -> tensor in `dtype` on `device`),
    put together from its per-expert weights (`read` gives one in high precision, dequantized
    where the checkpoint holds it in FP8). Only the shapes of `model`'s parameters are used."""
    grouped: Dict[Tuple[str, str], List[Tuple[str, Slot]]] = {}
    for key, (fqn, slot) in slots.items():
        grouped.setdefault((fqn, slot.param), []).append((key, slot))
    assembled = {}
    for (fqn, param), entries in grouped.items():
        shape = model.get_submodule(fqn)._parameters[param].shape
        expected = shape[0] * entries[0][1].parts
        if len(entries) != expected:
            raise ValueError(f"the checkpoint holds {len(entries)} of the {expected} per-expert weights of "
                             f"{fqn}.{param}; a shard is missing or it was written for another config.")
        full = torch.empty(shape, dtype=dtype, device=device)
        for key, slot in entries:
            target = expert_rows(full, slot)
            value = read(key)
            if tuple(value.shape) != tuple(target.shape):
                raise ValueError(f"{key} has shape {tuple(value.shape)} in the checkpoint; {type(model).__name__} "
                                 f"expects {tuple(target.shape)} for it in {fqn}.{param}.")
            target.copy_(value)
        assembled[f"{fqn}.{param}"] = full
    return assembled
