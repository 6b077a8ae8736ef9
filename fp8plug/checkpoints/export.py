"""Handing a model trained in FP8 on: plain torch modules in one call, and an FP8 checkpoint that
inference clients load.

Why a separate step: during training the Linears are an engine's FP8 modules, the forward is
wrapped by fp8plug's autocast (and accelerate's), and fp8plug keeps hooks on the model (plain
state-dict keys, the skipped-step guard, attention position notes). A model to ship (PEFT's
`merge_and_unload()`, `save_pretrained`, `torch.save`, `torch.jit.script`, `torch.export`) wants
plain `nn.Linear`s and none of that: `export_model` gives it.

The FP8 checkpoint (`save_fp8_checkpoint`) holds every eligible Linear's weight in float8_e4m3fn
with float32 scales, in the layout asked for (fp8plug.checkpoints.export_formats: "block", 128x128 tiles, which
transformers, vLLM and SGLang read, or "per_tensor", vLLM's and SGLang's), everything else in its
trained dtype, and config.json with the `quantization_config` those clients read. Scales come
from the final weights' own amax (max |w| / 448 per tile or tensor), not from the training run's
scaling state, which was set from the weights of the step before. The directory is replaced as
one change (fp8plug.checkpoints.export_dir).
"""

from __future__ import annotations

import logging
import os
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch
from accelerate.utils import extract_model_from_parallel
from torch import nn

from fp8plug._upstream import drop_original_forward, keep_in_fp32_patterns, matches_module_patterns
from fp8plug.api import loaded_engines, unconvert_model
from fp8plug.autocast import is_autowrapped, remove_fp8_autowrap
from fp8plug.backends.steps import untrack
from fp8plug.checkpoints import export_experts
from fp8plug.checkpoints import export_formats as formats
from fp8plug.checkpoints.export_dir import replacing
from fp8plug.layers.rules import IGNORED, check_module_names, linear_alignment_problem, module_paths
from fp8plug.recipe import module_name_list

logger = logging.getLogger("fp8plug")

E4M3_MAX = formats.E4M3_MAX
WEIGHTS_NAME = formats.WEIGHTS_NAME
quantize_weight = formats.quantize_per_tensor  # per-tensor, for a Linear outside a transformers model

_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks",
               "_state_dict_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks")
_HOOK_FLAGS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")
_DDP_IGNORE = "_ddp_params_and_buffers_to_ignore"


def export_model(model: nn.Module) -> nn.Module:
    """`model` as a plain torch model, changed in place and returned: every engine's FP8 modules
    swapped back for torch modules with the same (trained) weights; accelerate's and fp8plug's
    forward wrappers, torch.compile's wrapper (OptimizedModule, compiled submodules, in-place
    `compile()`) and every hook and attribute of fp8plug's removed. Accepts what
    `Accelerator.unwrap_model` returns, a DDP-wrapped or torch.compile'd model, or a PEFT model
    (then `merge_and_unload()` gives plain Linears with the adapters merged). The result runs
    exactly as the same architecture never converted, with these weights, would."""
    inner = _unwrapped(model)
    _plain_forward(inner)
    unconvert_model(inner)
    _uncompile(inner)
    _strip_fp8plug(inner)
    return inner


@dataclass
class FP8CheckpointReport:
    """What `save_fp8_checkpoint` wrote: the directory and layout, the Linears stored in FP8, those
    kept in high precision (with why), and the files."""

    directory: str
    layout: str = "block"
    quantized: List[str] = field(default_factory=list)
    experts: List[str] = field(default_factory=list)  # MoE experts modules stored in FP8, per expert
    kept: Dict[str, str] = field(default_factory=dict)  # name -> why not in FP8
    files: List[str] = field(default_factory=list)

    def __str__(self) -> str:
        kept = ", ".join(f"{n} ({why})" for n, why in self.kept.items()) or "none"
        scales = "128x128 block" if self.layout == "block" else "per-tensor"
        experts = f" and {len(self.experts)} MoE experts modules (per expert)" if self.experts else ""
        return (f"FP8 checkpoint in {self.directory}: {len(self.quantized)} Linear weights{experts} in float8_e4m3fn "
                f"with {scales} scales; kept in high precision: {kept}")


def save_fp8_checkpoint(model: nn.Module, directory: str, *, modules_to_ignore: Optional[Sequence[str]] = None,
                        layout: str = "block", max_shard_size="5GB") -> FP8CheckpointReport:
    """Write `model` (a transformers PreTrainedModel, exported or still converted by any engine) to
    `directory` as an FP8 inference checkpoint: safetensors (sharded past `max_shard_size`, with an
    index), config.json with its `quantization_config`, generation_config.json where the model
    generates. `layout`: "block" (transformers, vLLM, SGLang) or "per_tensor" (vLLM, SGLang; its
    config makes transformers refuse it);
    fp8plug.checkpoints.export_formats. The model is not changed; an older checkpoint in `directory` is
    replaced whole, other files there are kept (fp8plug.checkpoints.export_dir).

    Kept in high precision, and listed in the config: the output head and weights tied to another
    tensor, the Linears `modules_to_ignore` names (fully-qualified, checked as FP8RecipeKwargs
    checks them), those the model class keeps in float32, Linears whose width is not a multiple of
    16, in the block layout those with a width above 128 that is not a multiple of 128 (which
    transformers would read wrong: export_formats.block_width_problem), and the siblings vLLM
    fuses with any of these (q/k/v, gate/up).

    MoE experts (transformers 5's 3-D `gate_up_proj`/`down_proj`) are written in FP8 one weight
    per expert and projection, under the per-expert names transformers' `save_pretrained` writes
    (Mixtral `block_sparse_moe.experts.{e}.w1/w2/w3.weight`, Qwen3-MoE `mlp.experts.{e}.gate_proj/
    up_proj/down_proj.weight`), each with its scale: the layout vLLM's MoE loaders read (they take
    no fused names) and transformers' FP8 loader merges through the model's conversion mapping;
    the rest of the checkpoint takes save_pretrained's names too. Experts with biases or no
    per-expert names (GPT-OSS) stay in high precision and are listed; routers are written in high
    precision and not listed (neither client quantizes them). fp8plug.checkpoints.export_experts
    says which client reads which layout."""
    layout = formats.check_layout(layout)
    inner = _unwrapped(model)
    _refuse_unwritable(inner)
    ignore = () if modules_to_ignore is None else module_name_list(
        modules_to_ignore, "save_fp8_checkpoint(modules_to_ignore=...)")
    check_module_names(inner, ignore)
    state = _plain_weights(inner)
    linears = _linears(inner)
    report = FP8CheckpointReport(os.fspath(directory), layout)
    report.kept = _kept(inner, linears, state, ignore, layout)
    report.quantized = [name for name in linears if name not in report.kept]
    # MoE experts: FP8 per expert; every tensor under save_pretrained's names
    tensors, experts = export_experts.add_to_checkpoint(inner, report, _tensors(state, report.quantized, layout),
                                                        layout, ignore)
    if layout == "block":
        wide = [n for n in report.kept if n in linears and formats.block_width_problem(*linears[n].weight.shape)]
        if wide:
            logger.warning("fp8plug: %d Linears (%s%s) stay in high precision in the block layout: a width above 128 "
                           "that is not a multiple of 128 is read wrong by transformers; layout='per_tensor' stores "
                           "them in FP8 for vLLM and SGLang.", len(wide), ", ".join(wide[:3]),
                           ", ..." if len(wide) > 3 else "")
        refused = formats.block_warnings({n: linears[n] for n in report.quantized})
        refused += export_experts.block_warnings(inner, experts)
        if refused:
            logger.warning("fp8plug: vLLM refuses the block layout for a fused layer (q/k/v, gate/up, MoE experts' "
                           "gate/up) whose parts (but the last) have out_features not a multiple of 128, as %d here "
                           "(%s%s); use layout='per_tensor' for vLLM.",
                           len(refused), "; ".join(refused[:2]), ", ..." if len(refused) > 2 else "")
    entry = formats.model_config(inner)
    entry["quantization_config"] = formats.quantization_config(
        layout, export_experts.module_checkpoint_names(inner, report.kept))
    with replacing(directory) as work:
        report.files = formats.write_weights(tensors, work, max_shard_size)
        formats.write_json(os.path.join(work, "config.json"), entry)
        report.files.append("config.json")
        if _generates(inner):
            inner.generation_config.save_pretrained(work)
            report.files.append("generation_config.json")
    logger.info("fp8plug: %s", report)
    return report


def load_fp8_checkpoint(directory: str, model: Optional[nn.Module] = None) -> Dict[str, torch.Tensor]:
    """The state dict of a `save_fp8_checkpoint` directory (either layout, sharded or not) with
    every FP8 weight dequantized to float32 (fp8 x scale) and the scales dropped: what loads into
    the plain architecture, to check the checkpoint without an inference client. Keys are the
    checkpoint's (save_pretrained's names); given the `model` (its architecture, any weights),
    they are the model's, per-expert weights put back together into its 3-D experts parameters."""
    config = formats.read_json(os.path.join(directory, "config.json"), "load_fp8_checkpoint")
    block = (config.get("quantization_config") or {}).get("weight_block_size") or [formats.BLOCK]
    tensors = formats.read_weights(directory)
    state = {}
    for name, tensor in tensors.items():
        if name.endswith((".weight_scale", ".weight_scale_inv")):
            continue
        scale = formats.scale_of(tensors, name) if name.endswith(".weight") else None
        state[name] = formats.dequantize(tensor, scale, block[0]) if scale is not None else tensor
    return state if model is None else _model_state(model, state)


def _model_state(model: nn.Module, state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """`state` (checkpoint names) under `model`'s names, per-expert weights stacked into 3-D."""
    renamed, slots = export_experts.model_names(model, state)
    out = {renamed.get(k, k): v for k, v in state.items() if k not in slots}
    out.update(export_experts.assemble_experts(model, slots, state.__getitem__, torch.float32, "cpu"))
    return out


# export_model's parts -----------------------------------------------------------------------------
def _unwrapped(model: nn.Module) -> nn.Module:
    """The model inside DDP/DeepSpeed/FSDP and torch.compile wrappers (nothing changed)."""
    inner = extract_model_from_parallel(model, keep_fp32_wrapper=True, keep_torch_compile=False)
    while isinstance(inner, torch._dynamo.eval_frame.OptimizedModule):
        inner = inner._orig_mod
    return inner


def _plain_forward(model: nn.Module) -> None:
    """accelerate's autocast forward and fp8plug's FP8 one off: where the instance's forward only
    wraps the class's forward (through `__wrapped__`), the class's forward again; a forward of the
    user's own is kept, fp8plug's wrapper around it removed."""
    wrapped = drop_original_forward(model) | is_autowrapped(model)
    forward = model.__dict__.get("forward")
    if forward is not None and wrapped and _wraps_class_forward(model, forward):
        del model.forward
    else:
        remove_fp8_autowrap(model)


def _wraps_class_forward(model: nn.Module, forward) -> bool:
    target = type(model).forward
    for _ in range(64):  # a chain of wrappers, each naming the one inside as __wrapped__
        if forward is None:
            return False
        if forward is target or getattr(forward, "__func__", None) is target:
            return True
        forward = getattr(forward, "__wrapped__", None) or getattr(forward, "model_forward", None)
    return False


def _uncompile(model: nn.Module) -> None:
    """Compiled submodules replaced by the modules they wrap; in-place `compile()` undone."""
    optimized = torch._dynamo.eval_frame.OptimizedModule
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, optimized):
                setattr(module, child_name, _unwrapped(child))
    for module in model.modules():
        if getattr(module, "_compiled_call_impl", None) is not None:
            module._compiled_call_impl = None


def _strip_fp8plug(model: nn.Module) -> None:
    """Every hook whose code is fp8plug's, every `_fp8plug*` attribute, fp8plug's step tracking,
    and DDP ignore entries for buffers that no longer exist."""
    for module in model.modules():
        for dict_name in _HOOK_DICTS:
            hooks = getattr(module, dict_name, None)
            for key in [k for k, hook in (hooks or {}).items() if _is_ours(hook)]:
                del hooks[key]
                for flags in _HOOK_FLAGS:
                    getattr(module, flags, {}).pop(key, None)
        for name in [n for n in module.__dict__ if n.startswith("_fp8plug")]:
            delattr(module, name)
    untrack(model)
    if _DDP_IGNORE in model.__dict__:
        names = set(dict(model.named_parameters(remove_duplicate=False))) | set(dict(model.named_buffers()))
        left = [n for n in model.__dict__[_DDP_IGNORE] if n in names]
        if left:
            model.__dict__[_DDP_IGNORE] = left
        else:
            del model.__dict__[_DDP_IGNORE]


def _is_ours(hook) -> bool:
    for attribute in ("hook", "func"):  # torch's _WrappedHook, functools.partial
        hook = getattr(hook, attribute, hook)
    hook = getattr(hook, "__func__", hook)  # a bound method
    origin = getattr(hook, "__module__", None) or type(hook).__module__
    return origin == "fp8plug" or str(origin).startswith("fp8plug.")


# save_fp8_checkpoint's parts ----------------------------------------------------------------------
def _refuse_unwritable(model: nn.Module) -> None:
    """Refuse, before anything is written, what no client could load from this checkpoint."""
    _refuse_adapters(model)
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise TypeError(
            f"save_fp8_checkpoint: expected a transformers PreTrainedModel (it writes the model's config "
            f"with the quantization entry), got {type(model).__name__}; for other models use "
            "fp8plug.checkpoints.export_formats.quantize_blocks or quantize_per_tensor per Linear.")
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if tensor.is_meta:
            raise ValueError(
                f"save_fp8_checkpoint: {name} is on the meta device, so {type(model).__name__} has no weights "
                "to write (built under torch.device('meta') or init_empty_weights); load them first "
                "(from_pretrained, or model.to_empty(device='cpu') and load_state_dict), then export.")


def _refuse_adapters(model: nn.Module) -> None:
    peft = sys.modules.get("peft")
    if peft is None:
        return
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [n for n, m in model.named_modules() if isinstance(m, BaseTunerLayer)]
    if isinstance(model, peft.PeftModel) or layers:
        example = f" (e.g. {layers[0]!r})" if layers else ""
        raise ValueError(
            f"save_fp8_checkpoint: {type(model).__name__} still holds PEFT adapters{example}: written as it is, "
            "its weights would be stored under base_model.model.* keys and each LoRA matrix quantized as a "
            "Linear of its own, which no client loads. Merge them first: "
            "model = fp8plug.export_model(model).merge_and_unload(), then save_fp8_checkpoint(model, ...).")


def _linears(model: nn.Module) -> Dict[str, nn.Module]:
    """name -> each Linear the checkpoint may store in FP8 (nn.Linear, or an engine's FP8 Linear)."""
    engines = loaded_engines()
    return {name: m for name, m in model.named_modules()
            if name and (isinstance(m, nn.Linear) or any(e.is_converted(m) for e in engines))
            and isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 2}


def _kept(model: nn.Module, linears: Dict[str, nn.Module], state: Dict[str, torch.Tensor],
          ignore: Sequence[str], layout: str) -> Dict[str, str]:
    """name -> why, for each of `linears` that stays in high precision (save_fp8_checkpoint's list)."""
    holders = defaultdict(list)  # data_ptr -> the state-dict keys sharing that storage
    for key, tensor in state.items():
        if tensor.numel():
            holders[tensor.data_ptr()].append(key)
    paths = module_paths(model)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    fp32 = keep_in_fp32_patterns(model)
    engines = loaded_engines()
    kept: Dict[str, str] = {}
    for name, module in linears.items():
        key = f"{name}.weight"
        shared = holders.get(state[key].data_ptr(), [key]) if key in state else [key]
        if shared[0] != key:
            kept[name] = f"tied to {shared[0]}"
        elif len(shared) > 1:
            kept[name] = f"shares its weight with {', '.join(shared[1:])}"
        elif head is not None and module is head:
            kept[name] = "the output head (vLLM and SGLang run it unquantized)"
        elif set(ignore) & set(paths.get(name, [name])):
            kept[name] = IGNORED
        elif matches_module_patterns(name, fp32):
            kept[name] = "kept in float32 by its model class"
        elif type(module) is not nn.Linear and not any(e.is_converted(module) for e in engines):
            kept[name] = f"a {type(module).__name__}, not an nn.Linear (transformers converts only nn.Linear)"
        elif module.weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            kept[name] = f"weight in {module.weight.dtype}"
        else:
            why = linear_alignment_problem(module)
            if not why and layout == "block":
                why = formats.block_width_problem(*module.weight.shape)
            if why:
                kept[name] = why
    siblings = formats.fused_siblings(linears)
    changed = True
    while changed:  # vLLM fuses q/k/v and gate/up into one layer of one precision
        changed = False
        for name, others in siblings.items():
            reason = next((o for o in others if o in kept), None)
            if name not in kept and reason is not None:
                kept[name] = f"fused with {reason} in vLLM and SGLang, which is kept"
                changed = True
    return dict(sorted(kept.items()))


def _tensors(state: Dict[str, torch.Tensor], quantized: List[str], layout: str) -> Dict[str, torch.Tensor]:
    """The checkpoint's tensors: each storage once (tied weights under their first name), the
    `quantized` Linears' weights in FP8 with their scales."""
    fp8 = {f"{name}.weight": name for name in quantized}
    scale_name = formats.SCALE_NAMES[layout]
    seen, tensors = set(), {}
    for key, tensor in state.items():
        if tensor.numel() and tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        if key in fp8:
            tensors[key], tensors[f"{fp8[key]}.{scale_name}"] = formats.quantize(tensor, layout)
        else:
            tensors[key] = tensor.detach()
    return tensors


def _generates(model: nn.Module) -> bool:
    can = getattr(model, "can_generate", None)
    return getattr(model, "generation_config", None) is not None and callable(can) and bool(can())


def _plain_weights(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The model's state dict with the plain architecture's keys (every engine's entries dropped)."""
    state = model.state_dict()
    for engine in loaded_engines():
        state = engine.plain_state_dict(state)
    return state
