"""transformers' SDPA attention without a built causal mask under torch.compile.

Why: a transformers model on its default attention ("sdpa") builds a 4-D causal mask for each
forward unless it can prove the mask is plain causal, in which case it hands SDPA `is_causal=True`
and no mask. Eagerly it proves that whenever no padding mask was passed (or the padding mask is
all ones). Under torch.compile it never does on torch < 2.14: its check asks
`torch.compiler.is_exporting()`, which dynamo answered True while compiling before
pytorch#176499 (transformers' masking_utils says so). The compiled model then runs attention
with a materialised mask: SDPA cannot take its causal kernels, so cuDNN runs the full square
with a mask read, or torch falls to its memory-efficient kernel, and grouped-query models also
repeat K and V to every head. Measured on the benchmark Llama (H100, docs/performance.md,
"Session 11"): 13.6 ms of attention a step compiled against 4.8 ms eagerly, and 33 ms under
PEFT LoRA, where the memory-efficient kernel ran.

What: fp8plug registers one attention implementation, FP8PLUG_SDPA, with transformers'
registries: its attention function is transformers' own SDPA function, unchanged; its mask
function is transformers' `sdpa_mask` except in the one case transformers skips eagerly and that
needs no data read: a plain causal mask (`causal_mask_function`, no sliding window or chunk, no
packed sequences or added mask patterns: transformers turns `allow_is_causal_skip` off for
those) with no padding mask at all and as many keys as queries (no cache). There it returns None,
so the SDPA function passes `is_causal=True`, compiled or not. The attention computed is the
same; only the kernel differs. A padding mask (even all ones) still builds the mask under
torch.compile, as in transformers.

Conversion (fp8plug.api.convert_with_plan) switches a transformers model whose attention is
"sdpa" to FP8PLUG_SDPA where the recipe's `skip_causal_mask` is on (the default), and says so
once in the `fp8plug` log; `unconvert_model` and `export_model` switch it back, so a shipped model
names "sdpa". Caveat: `torch.export` of a model still on FP8PLUG_SDPA hard-codes is_causal for
the traced shapes; export after `fp8plug.export_model`.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator, Optional

from torch import nn

logger = logging.getLogger("fp8plug")

FP8PLUG_SDPA = "fp8plug_sdpa"
SDPA = "sdpa"
_logged = set()


def _registered() -> bool:
    """Register FP8PLUG_SDPA with transformers' attention and mask registries (once); False where
    this transformers has no such registries."""
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface
    except ImportError:
        return False
    if FP8PLUG_SDPA not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionInterface.register(FP8PLUG_SDPA, ALL_ATTENTION_FUNCTIONS[SDPA])
        AttentionMaskInterface.register(FP8PLUG_SDPA, causal_or_sdpa_mask)
    return True


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
    q_length = kwargs.get("q_length")
    if q_length is None and kwargs.get("cache_position") is not None:  # older transformers
        q_length = kwargs["cache_position"].shape[0]
    kv_length = kwargs.get("kv_length")
    if q_length is None or kv_length is None or kwargs.get("kv_offset", 0) != 0:
        return False
    return q_length == kv_length


def _transformers_models(model: nn.Module) -> Iterator[nn.Module]:
    """The outermost transformers PreTrainedModels in `model` (itself, or the ones it wraps, as a
    PEFT model wraps one)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return
    stack = [model]
    while stack:
        module = stack.pop()
        if isinstance(module, PreTrainedModel):
            yield module
        else:
            stack.extend(module.children())


def _implementations(model: nn.Module) -> set:
    """The attention implementations `model`'s config and its sub-configs name."""
    names, configs = set(), [model.config]
    while configs:
        config = configs.pop()
        names.add(getattr(config, "_attn_implementation", None))
        configs.extend(c for key in getattr(config, "sub_configs", {}) or {}
                       if (c := getattr(config, key, None)) is not None)
    return names


def _set(model: nn.Module, name: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # pragma: no cover - transformers without set_attn_implementation
        model.config._attn_implementation = name


def skip_causal_mask(model: nn.Module) -> bool:
    """Switch every transformers model in `model` whose attention is "sdpa" (all of its configs)
    to FP8PLUG_SDPA; logs once per model class. Returns whether any was switched."""
    switched = False
    for hf_model in _transformers_models(model):
        if _implementations(hf_model) != {SDPA} or not _registered():
            continue
        _set(hf_model, FP8PLUG_SDPA)
        switched = True
        name = type(hf_model).__name__
        if name not in _logged:
            _logged.add(name)
            logger.info(
                "fp8plug: %s: attention through %r, transformers' SDPA that passes is_causal=True instead of a "
                "built causal mask wherever no padding mask is given, under torch.compile too (transformers "
                "builds the mask whenever it compiles on torch < 2.14); skip_causal_mask=False keeps 'sdpa'.",
                name, FP8PLUG_SDPA)
    return switched


def restore_sdpa(model: nn.Module) -> None:
    """Put "sdpa" back wherever skip_causal_mask switched a model to FP8PLUG_SDPA."""
    for hf_model in _transformers_models(model):
        if FP8PLUG_SDPA in _implementations(hf_model):
            _set(hf_model, SDPA)
