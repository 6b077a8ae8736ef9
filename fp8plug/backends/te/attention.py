"""TransformerEngine's FP8 dot-product attention, for one transformers attention module.

Builds TE's `DotProductAttention` for one attention shape and calls it in FP8 under
`DelayedScaling(fp8_dpa=True)` (cuDNN's FP8 fused attention) on queries, keys and values as
transformers hands them. When to call it, and the fall-back to SDPA, are decided by
fp8plug.hf.fp8_attention, its only user: FP8 attention is a recipe field every engine honours
(`fp8_dpa`), not part of the te engine. TransformerEngine is imported only through te/imports.py,
once FP8 attention is in use; `fp8_attention_problem` says, without raising, why it cannot run.
"""

from __future__ import annotations

import importlib
from typing import Any, Dict, Optional, Tuple

import torch

from fp8plug.backends.base import probe_import
from fp8plug.backends.te.imports import (
    TE_MODULE,
    TEApi,
    import_te,
    share_torch_cudnn,
    state_manager,
    te_version,
)
from fp8plug.tuning.hardware import DeviceInfo, device_info

# cuDNN's FP8 fused attention is Hopper's and later (TE disables its FP8 attention elsewhere)
MIN_CAPABILITY = (9, 0)
INSTALL = 'pip install "transformer_engine[pytorch]"'


def fp8_attention_problem(device=None) -> Optional[str]:
    """Why TE's FP8 attention cannot run on `device` (a DeviceInfo, a torch device, or None for the
    current CUDA GPU), or None. Never raises: a missing or broken TransformerEngine is a reason
    like any other. The GPU is checked first, so a machine without one never imports TE."""
    if device is None and not torch.cuda.is_available():
        return "no CUDA GPU is visible"
    info = device if isinstance(device, DeviceInfo) else device_info(device)
    if info.type != "cuda":
        return f"{info.describe()} is not a CUDA GPU"
    if info.capability is None or info.capability < MIN_CAPABILITY:
        major, minor = info.capability or (0, 0)
        return (f"{info.name} is compute capability {major}.{minor}; cuDNN's FP8 attention needs 9.0 or newer "
                "(Hopper, Blackwell)")
    share_torch_cudnn()
    probe = probe_import(TE_MODULE)
    if not probe.available:
        return f"TransformerEngine is {probe.reason} ({INSTALL})"
    te = importlib.import_module(TE_MODULE)
    try:
        recipe = importlib.import_module("transformer_engine.common.recipe")
        has_fp8_dpa = "fp8_dpa" in getattr(recipe.DelayedScaling, "__dataclass_fields__", {})
    except Exception as exc:  # noqa: BLE001 - a broken install is a reason, not a crash
        return f"TransformerEngine {te_version()} has no usable recipe module: {type(exc).__name__}: {exc}"
    if not has_fp8_dpa or not hasattr(te, "DotProductAttention"):
        return (f"TransformerEngine {te_version()} has no FP8 attention (DotProductAttention with "
                f"DelayedScaling(fp8_dpa=True)); upgrade it ({INSTALL} --upgrade)")
    check = getattr(te, "is_fp8_available", None)
    if check is not None:
        try:
            result = check(return_reason=True)
        except Exception as exc:  # noqa: BLE001
            return f"TransformerEngine could not check FP8 support: {type(exc).__name__}: {exc}"
        available, reason = result if isinstance(result, tuple) else (bool(result), "")
        if not available:
            return f"TransformerEngine says FP8 is unavailable: {reason}"
    return None


_RECIPES: Dict[Tuple, Any] = {}


def attention_recipe(fp8_format: str, margin: int, amax_history_len: int, amax_compute_algo: str,
                     reduce_amax: bool):
    """TE's `DelayedScaling(fp8_dpa=True)` with these settings, one object per distinct settings:
    TE keys its amax buffers by the recipe, so every attention module with the same settings
    shares one reduction."""
    key = (fp8_format, margin, amax_history_len, amax_compute_algo, reduce_amax)
    if key not in _RECIPES:
        module = importlib.import_module("transformer_engine.common.recipe")
        _RECIPES[key] = module.DelayedScaling(
            fp8_format=module.Format[fp8_format], margin=margin, amax_history_len=amax_history_len,
            amax_compute_algo=amax_compute_algo, reduce_amax=reduce_amax, fp8_dpa=True)
    return _RECIPES[key]


def _bshd(t: torch.Tensor) -> torch.Tensor:
    """[B, H, T, D] as TE's "bshd" takes it: [B, T, H, D] with heads and head dim contiguous (TE
    views them as one). transformers' Llama-style tensors are laid out so already (no copy); a
    model that hands contiguous [B, H, T, D] gets one copy (TE 2.20 refused those with a view error
    on an H100)."""
    t = t.transpose(1, 2)
    return t if t.stride(3) == 1 and t.stride(2) == t.shape[3] else t.contiguous()


class _UpdateBackwardScales(torch.autograd.Function):
    """The identity on (query, key, value), put before the attention: its backward runs right after
    the attention's has written its gradient amaxes, and updates every backward scale TE holds.

    TE (2.20) reduces backward amaxes only at the end of the first FP8 Linear's backward in an
    autocast region; DotProductAttention never does. Without a TE Linear around (the native or ao
    engine) the scales of dO, dP and dQKV would stay at 1.0, and gradients as small as a loss
    averaged over thousands of tokens gives would flush to zero in E5M2. An update more than once a
    step is harmless: a module whose amax slot is still empty keeps its scale, and its history gains
    a zero (with amax_compute_algo="max" the history then covers fewer steps)."""

    @staticmethod
    def forward(ctx, query, key, value):
        return query.view_as(query), key.view_as(key), value.view_as(value)

    @staticmethod
    def backward(ctx, *grads):
        state_manager().reduce_and_update_fp8_tensors(forward=False)
        return grads


class TEAttention:
    """TE's DotProductAttention for one attention shape: causal, no mask, no dropout, grouped-query
    heads as TE's `num_gqa_groups`, in FP8 under `recipe`. `calls` counts the calls that ran.

    transformers' Llama-style modules hand [B, H, T, D] tensors that are transposed views of
    [B, T, H, D] projections (RoPE keeps that layout), so TE's "bshd" format takes them with a
    transpose and no copy; the output comes back as [B, T, H, D], as transformers expects."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, value_dim: int, softmax_scale: Optional[float],
                 recipe, device: torch.device):
        te = import_te()
        self.api = TEApi(te)
        self.recipe = recipe
        self.calls = 0
        with torch.cuda.device(device):
            self.dpa = te.DotProductAttention(
                heads, head_dim if head_dim == value_dim else (head_dim, value_dim), num_gqa_groups=kv_heads,
                attention_dropout=0.0, qkv_format="bshd", attn_mask_type="causal", softmax_scale=softmax_scale)

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, training: bool) -> torch.Tensor:
        """Attention of [B, H, T, D] query, key and value ([B, Hkv, T, D]), all of one dtype
        (bfloat16 or float16); returns [B, T, H, Dv] in it."""
        if self.dpa.training != training:
            self.dpa.train(training)
        if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
            query, key, value = _UpdateBackwardScales.apply(query, key, value)
        batch, heads, tokens, _ = query.shape
        # the inputs are in the dtype to compute in already; torch's autocast stays out of TE's way.
        # TE reduces the forward amaxes and updates those scales itself, when the outermost TE autocast
        # exits with grad enabled: this one, or the te engine's where one encloses it.
        with torch.cuda.device(query.device), torch.autocast(query.device.type, enabled=False), \
                self.api.autocast(enabled=True, recipe=self.recipe):
            out = self.dpa(*(_bshd(t) for t in (query, key, value)))
        self.calls += 1
        return out.reshape(batch, tokens, heads, value.shape[-1])

    def scaling_state(self) -> Dict[str, torch.Tensor]:
        """The TE module's delayed-scaling tensors, "fwd_amax_history", "fwd_scale", "bwd_amax_history"
        and "bwd_scale" (none before its first FP8 call): what shows that FP8 casts ran and that
        both directions' scales are kept up to date (the GPU tests read it)."""
        meta = getattr(self.dpa, "fp8_meta", None) or {}
        found = {}
        for direction in ("fwd", "bwd"):
            state = meta.get(f"scaling_{direction}")
            for name in ("amax_history", "scale"):
                value = getattr(state, name, None)
                if isinstance(value, torch.Tensor):
                    found[f"{direction}_{name}"] = value
        return found
