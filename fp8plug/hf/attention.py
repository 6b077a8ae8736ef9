"""transformers' SDPA attention without a built causal mask under torch.compile.

Why: a transformers model on its default attention ("sdpa") hands SDPA `is_causal=True` and no
mask where it can prove the mask is plain causal, and otherwise builds a 4-D boolean mask. Under
torch.compile it cannot prove it: the model makes its own position ids when none are passed,
and transformers checks them for packed sequences, a check that needs their values, so while
compiling it assumes packing and builds the mask (read in transformers 5.10, 5.17 and 5.23; a
model with a KV cache in use skips the check). SDPA then cannot take
its causal kernels: cuDNN runs the full square with the mask read, or torch falls back to its
memory-efficient kernel, and grouped-query models repeat K and V to every head first. Measured
on the benchmark Llama (H100, docs/attention.md): attention 0.77 + 2.34 ms a
layer compiled against 0.26 + 0.70 eagerly (forward + backward), and 33 ms a step under PEFT
LoRA, where the memory-efficient kernel ran.

What: two pieces, both only for models fp8plug converted.
- While such a model runs a forward to which no position ids were passed (it makes consecutive
  ones itself, so nothing can be packed), transformers' packed-sequence check answers
  "not packed" (fp8plug._upstream.report_unpacked_while; a forward hook that always runs ends it).
- The model's attention is FP8PLUG_SDPA, registered with transformers' registries: its attention
  function is transformers' own SDPA function, unchanged; its mask function is transformers'
  `sdpa_mask` except where the mask is plain causal (`causal_mask_function`; transformers turns
  `allow_is_causal_skip` off for packed sequences and added mask patterns, and passes
  `local_size` for sliding windows and chunks), no padding mask was passed and keys and queries
  are as many (no cache). There it returns None, so the SDPA function passes `is_causal=True`,
  compiled or not, as transformers does eagerly in that case.
The attention computed is the same; only the kernel differs. A padding mask (even all ones) or
position ids passed by the caller still build the mask under torch.compile, as in transformers.

Conversion (fp8plug.conversion.apply) switches a transformers model whose attention is
"sdpa" to FP8PLUG_SDPA where the recipe's `skip_causal_mask` is on (the default), and says so
once in the `fp8plug` log; `unconvert_model` and `export_model` switch it back, so a shipped model
names "sdpa". Caveat: `torch.export` of a model still on FP8PLUG_SDPA hard-codes is_causal for
the traced shapes; export after `fp8plug.export_model`.

FP8 attention (the recipe's `fp8_dpa`, fp8plug.hf.fp8_attention) registers a second name,
FP8PLUG_FP8_DPA, with the same mask function and hooks (`register_attention`,
`switch_attention`); `restore_sdpa` undoes either.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable, Iterator, Optional

from torch import nn

from fp8plug._upstream import attention_implementation, report_unpacked_while

logger = logging.getLogger("fp8plug")

FP8PLUG_SDPA = "fp8plug_sdpa"
FP8PLUG_FP8_DPA = "fp8plug_fp8_dpa"  # fp8plug.hf.fp8_attention: FP8PLUG_SDPA's mask, FP8 attention where it can
SWITCHED = (FP8PLUG_SDPA, FP8PLUG_FP8_DPA)  # what restore_sdpa puts back to "sdpa"
SDPA = "sdpa"
_logged = set()


class _Positions:
    """Whether the converted transformers model now running makes its own position ids."""

    own = False


_POSITIONS = _Positions()


def _note_positions(module: nn.Module, args, kwargs) -> None:
    """Forward pre-hook: no position ids passed (by keyword, nor a second positional argument)."""
    _POSITIONS.own = len(args) <= 1 and kwargs.get("position_ids") is None


def _end_positions(module: nn.Module, args, kwargs, output) -> None:
    """Forward hook, run even when the forward raises: the next model's positions are its own business."""
    _POSITIONS.own = False


def _positions_are_own() -> bool:
    return _POSITIONS.own


def register_attention(name: str, function: Optional[Callable] = None) -> None:
    """Register `name` with transformers' attention and mask registries (once): `function` as its
    attention function (None: transformers' own SDPA function), `causal_or_sdpa_mask` as its mask
    function. A name with no mask function would get no mask at all from transformers, padding
    included, so both registries always get one."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    if name not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, function or ALL_ATTENTION_FUNCTIONS[SDPA])
        AttentionMaskInterface.register(name, causal_or_sdpa_mask)


def causal_or_sdpa_mask(*args, **kwargs) -> Optional[Any]:
    """transformers' sdpa_mask, or None (SDPA's is_causal) where the mask is plain causal, no
    padding mask was given and keys and queries are as many (see the module doc)."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    if not args and _plain_causal(kwargs, causal_mask_function):
        return None
    return sdpa_mask(*args, **kwargs)


def _plain_causal(kwargs, causal_mask_function) -> bool:
    """Whether the keyword arguments transformers passes describe a plain causal mask over as many
    keys as queries, with no padding mask. Arguments this function does not know (another
    transformers' signature) count as not plain."""
    if not kwargs.get("allow_is_causal_skip", True) or kwargs.get("attention_mask") is not None:
        return False
    if kwargs.get("mask_function", causal_mask_function) is not causal_mask_function:
        return False
    if kwargs.get("local_size") is not None:
        return False
    q_length, kv_length = kwargs.get("q_length"), kwargs.get("kv_length")
    if q_length is None or kv_length is None or kwargs.get("kv_offset", 0) != 0:
        return False
    return q_length == kv_length


def loaded_pretrained_model_class() -> Optional[type]:
    """transformers' PreTrainedModel where transformers' modeling code is already imported, else
    None: no transformers model can exist before it is, so a plain torch model never imports
    transformers (whose import loads torchao and prints its noise, and takes seconds)."""
    modeling_utils = sys.modules.get("transformers.modeling_utils")
    return getattr(modeling_utils, "PreTrainedModel", None)


def transformers_models(model: nn.Module) -> Iterator[nn.Module]:
    """The outermost transformers PreTrainedModels in `model` (itself, or the ones it wraps, as a
    PEFT model wraps one)."""
    PreTrainedModel = loaded_pretrained_model_class()
    if PreTrainedModel is None:
        return
    stack = [model]
    while stack:
        module = stack.pop()
        if isinstance(module, PreTrainedModel):
            yield module
        else:
            stack.extend(module.children())


def _transformers_models_within(model: nn.Module) -> Iterator[nn.Module]:
    """`model` and every transformers model inside it (a CausalLM holds its base model): each is
    called with the caller's position ids or none, so each notes which."""
    PreTrainedModel = loaded_pretrained_model_class()
    return (m for m in model.modules() if PreTrainedModel is not None and isinstance(m, PreTrainedModel))


def model_configs(model: nn.Module) -> Iterator[Any]:
    """`model`'s config and its sub-configs (a multimodal model's text and vision configs)."""
    configs = [model.config]
    while configs:
        config = configs.pop()
        yield config
        configs.extend(c for key in getattr(config, "sub_configs", {}) or {}
                       if (c := getattr(config, key, None)) is not None)


def implementations(model: nn.Module) -> set:
    """The attention implementations `model`'s config and its sub-configs name."""
    return {attention_implementation(config) for config in model_configs(model)}


def switch_attention(hf_model: nn.Module, name: str) -> None:
    """Put one transformers model on attention `name` (registered with register_attention), with
    the forward hooks that note whether the caller passed position ids (see the module doc)."""
    hf_model.set_attn_implementation(name)
    report_unpacked_while(_positions_are_own)
    for module in _transformers_models_within(hf_model):
        if _note_positions not in module._forward_pre_hooks.values():
            module.register_forward_pre_hook(_note_positions, with_kwargs=True)
            module.register_forward_hook(_end_positions, with_kwargs=True, always_call=True)


def skip_causal_mask(model: nn.Module) -> bool:
    """Switch every transformers model in `model` whose attention is "sdpa" (all of its configs)
    to FP8PLUG_SDPA; logs once per model class. Returns whether any was switched."""
    switched = False
    for hf_model in transformers_models(model):
        if implementations(hf_model) != {SDPA}:
            continue
        register_attention(FP8PLUG_SDPA)
        switch_attention(hf_model, FP8PLUG_SDPA)
        switched = True
        name = type(hf_model).__name__
        if name not in _logged:
            _logged.add(name)
            logger.info(
                "fp8plug: %s: attention through %r, transformers' SDPA with is_causal=True instead of a built "
                "causal mask where neither a padding mask nor position ids are passed, under torch.compile too "
                "(where transformers builds the mask); skip_causal_mask=False keeps 'sdpa'.",
                name, FP8PLUG_SDPA)
    return switched


def restore_sdpa(model: nn.Module) -> None:
    """Put "sdpa" back wherever conversion switched a model to FP8PLUG_SDPA or FP8PLUG_FP8_DPA
    (fp8plug.hf.fp8_attention), and its hooks off."""
    for hf_model in transformers_models(model):
        if implementations(hf_model) & set(SWITCHED):
            hf_model.set_attn_implementation(SDPA)
        for module in _transformers_models_within(hf_model):
            for hooks, hook in ((module._forward_pre_hooks, _note_positions), (module._forward_hooks, _end_positions)):
                for key in [k for k, fn in hooks.items() if fn is hook]:
                    del hooks[key]
                    module._forward_hooks_always_called.pop(key, None)
                    module._forward_pre_hooks_with_kwargs.pop(key, None)
                    module._forward_hooks_with_kwargs.pop(key, None)
