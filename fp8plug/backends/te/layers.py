"""Private helper of the te engine (fp8plug/backends/te/engine.py): the converted Linear and checkpoints.

TELinear (te.Linear plus token padding, the high-precision path where padding cannot help, and
the micro-batch flag), which TE modules count as converted, and the state-dict hooks that let a
converted model load a plain checkpoint. Imported by engine.py only.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections import OrderedDict
from typing import Any, Dict, Mapping, Optional, Tuple

import torch
from torch import nn

from fp8plug.backends.padding import pad_tokens
from fp8plug.backends.te.imports import TE_MODULE, TEApi, import_te, state_manager
from fp8plug.backends.te.recipes import recipe_kind

EXTRA_STATE = "_extra_state"  # torch's suffix for get_extra_state entries


def gemm_alignment(kind: str) -> Tuple[int, int]:
    """(token multiple, feature multiple) an FP8 GEMM input needs under a recipe kind. For FP8
    per-tensor and block scaling, TE's forward check (assert_dim_for_fp8_exec) takes tokens in
    multiples of 8, but the weight-gradient GEMM has the tokens as its leading dimension, which
    cuBLASLt wants in multiples of 16 (an H100 rejected 8-aligned padding with "lda % 16 == 0");
    MXFP8 has 32-element blocks, NVFP4 16-element blocks."""
    return {"mxfp8": (32, 32), "nvfp4": (16, 16)}.get(kind, (16, 16))


def fp8_token_multiple(inp, kind: str = "fp8") -> Optional[int]:
    """How an input goes through TE's FP8 GEMM under a recipe kind: 1 as it is, a larger number:
    after padding its tokens up to a multiple of it, None: not at all (features misaligned, no
    token dimension or no rows, or tokens misaligned in a tensor that is not a plain one, such
    as TE's own quantized tensors, which are never padded)."""
    shape = tuple(inp.shape)
    if len(shape) < 2 or math.prod(shape[:-1]) == 0:
        return None
    tokens, features = gemm_alignment(kind)
    if shape[-1] % features:
        return None
    if math.prod(shape[:-1]) % tokens == 0:
        return 1
    return tokens if type(inp) in (torch.Tensor, nn.Parameter) else None


# --- micro-batches -----------------------------------------------------------------------------------


class _Microbatch:
    """The is_first_microbatch value TELinear passes to TE; None (the default) passes nothing."""

    is_first: Optional[bool] = None


@contextlib.contextmanager
def microbatch(is_first: Optional[bool]):
    """Run the block as one micro-batch of gradient accumulation (see the module docstring)."""
    previous = _Microbatch.is_first
    _Microbatch.is_first = None if is_first is None else bool(is_first)
    try:
        yield
    finally:
        _Microbatch.is_first = previous


# --- the converted Linear (a te.Linear subclass, built when TE is first needed) ------------------------

_CLASSES: Dict[str, type] = {}


def te_linear_class() -> type:
    """TELinear: te.Linear plus token padding for inputs TE's FP8 GEMM would reject (and the
    high-precision path where padding cannot help) and the micro-batch flag. Built on first use
    (it subclasses a TE class) and reachable as `fp8plug.backends.te.engine.TELinear`, so converted
    models pickle."""
    cls = _CLASSES.get("TELinear")
    if cls is not None:
        return cls
    te_module = import_te()
    api = TEApi(te_module)
    manager = state_manager()

    class TELinear(te_module.Linear):
        """te.Linear that pads an input's tokens up to what TE's FP8 GEMMs take (e.g. 7 tokens to
        16), runs a forward in high precision when padding cannot help (features misaligned), and
        takes is_first_microbatch from fp8plug.backends.te.engine.microbatch."""

        def forward(self, inp, *args, **kwargs):
            if not args and "is_first_microbatch" not in kwargs and _Microbatch.is_first is not None:
                kwargs["is_first_microbatch"] = _Microbatch.is_first
            if manager.is_fp8_enabled():
                recipe = manager.get_fp8_recipe()
                multiple = fp8_token_multiple(inp, recipe_kind(recipe))
                if multiple is None:
                    with api.autocast(enabled=False, recipe=recipe):
                        return super().forward(inp, *args, **kwargs)
                if multiple > 1:
                    return self._padded_forward(inp, multiple, args, kwargs)
            return super().forward(inp, *args, **kwargs)

        def _padded_forward(self, inp, multiple, args, kwargs):
            extra = []  # te.Linear(return_bias=True) returns (output, bias): pad the output only

            def run(rows):
                out = super(TELinear, self).forward(rows, *args, **kwargs)
                if isinstance(out, tuple):
                    extra.extend(out[1:])
                    return out[0]
                return out

            out = pad_tokens(run, inp, multiple)
            return (out, *extra) if extra else out

        def fp8_call(self, inp) -> bool:
            """Whether a call on `inp` runs in FP8 now (padded or not): fp8plug's GEMM count asks."""
            if not manager.is_fp8_enabled():
                return False
            return fp8_token_multiple(inp, recipe_kind(manager.get_fp8_recipe())) is not None

    TELinear.__module__ = "fp8plug.backends.te.engine"  # where converted models unpickle it from
    TELinear.__qualname__ = "TELinear"
    _CLASSES["TELinear"] = TELinear
    return TELinear


def te_module_types() -> Tuple[type, ...]:
    """The TE module classes that count as converted (empty while TE is not imported)."""
    te = sys.modules.get(TE_MODULE)
    if te is None:
        return ()
    types = []
    base = getattr(sys.modules.get("transformer_engine.pytorch.module.base"), "TransformerEngineBaseModule", None)
    for candidate in (base, getattr(te, "Linear", None), getattr(te, "LayerNorm", None),
                      getattr(te, "RMSNorm", None), getattr(te, "TransformerLayer", None)):
        if isinstance(candidate, type):
            types.append(candidate)
    return tuple(types)


# --- checkpoints ---------------------------------------------------------------------------------------


def _is_te_extra_state(key: str, value) -> bool:
    """TE's `_extra_state` entries: a uint8 tensor (its pickle), an empty tensor (what it writes
    when it has nothing to keep; fp8plug.checkpoints.state also asks with empty placeholders), or the
    io.BytesIO of old TE versions. Other modules' extra state (say a dict) is left alone."""
    if key.rpartition(".")[2] != EXTRA_STATE:
        return False
    import io

    if isinstance(value, torch.Tensor):
        return value.dtype == torch.uint8 or value.numel() == 0
    return isinstance(value, io.BytesIO)


def drop_extra_state(state_dict: Mapping[str, Any]) -> "OrderedDict[str, Any]":
    """`state_dict` without TE's `_extra_state` entries (TEEngine.plain_entries)."""
    return OrderedDict((k, v) for k, v in state_dict.items() if not _is_te_extra_state(k, v))


def supply_extra_state(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    """load_state_dict pre-hook: a plain checkpoint has no `_extra_state` for a TE module; supply
    the empty one TE itself writes when it has nothing to keep, so a strict load succeeds."""
    key = prefix + EXTRA_STATE
    if key not in state_dict:
        state_dict[key] = torch.empty(0, dtype=torch.uint8)


def accept_plain_state_dict(module: nn.Module) -> None:
    """Let `module` (a TE module) load a state dict that lacks its `_extra_state`, once."""
    if getattr(module, "_fp8plug_plain_loads", False):
        return
    module.register_load_state_dict_pre_hook(supply_extra_state)
    module._fp8plug_plain_loads = True


def load_plain_state_dict(model: nn.Module, state_dict: Mapping[str, Any], strict: bool = True):
    """Load a plain (unconverted) checkpoint into a converted model, strictly by default."""
    types = te_module_types()
    if types:
        for module in model.modules():
            if isinstance(module, types):
                accept_plain_state_dict(module)
    return model.load_state_dict(state_dict, strict=strict)
