"""The FP8 quantization a layer's scaling implies, emulated in float32, and what it costs an operand.

Why: the numerics watch must judge every engine's layers alike, so it does not read an engine's
FP8 copies (TransformerEngine and torchao keep theirs inside fused kernels); it re-quantizes the
operand the layer was given with the scale the layer uses (the engine's own where it tells us,
fp8plug.backends.base OPTIONAL "operand_scales", else the current amax's) at the scaling's
granularity (one scale per tensor, per row, or per tile), and compares with float32.

All functions are plain tensor code run under no_grad, only on the steps the watch checks.
"""

from __future__ import annotations

import math
from typing import Dict, Union

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}
BLOCK = 128  # DeepSeek-V3's tiles: 1x128 for activations and gradients, 128x128 for weights
GRANULARITIES = ("tensor", "rowwise", "blockwise")

Scale = Union[None, str, torch.Tensor]


def _tiles(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """`t` (2-D) zero-padded to whole (rows x cols) tiles, as (row tiles, rows, col tiles, cols)."""
    pad_r, pad_c = (-t.shape[0]) % rows, (-t.shape[1]) % cols
    if pad_r or pad_c:
        t = torch.nn.functional.pad(t, (0, pad_c, 0, pad_r))
    return t.reshape(t.shape[0] // rows, rows, t.shape[1] // cols, cols)


def amax_scale(t: torch.Tensor, dtype: torch.dtype, granularity: str = "tensor", weight: bool = False) -> torch.Tensor:
    """The scale (fp8_max / amax) of 2-D `t` at `granularity`, broadcastable to `t`: a scalar,
    one per row, or one per tile (1x128; 128x128 for a `weight`). An all-zero group keeps 1."""
    t = t.float().abs()
    if granularity == "tensor":
        amax = t.amax()
    elif granularity == "rowwise":
        amax = t.amax(dim=-1, keepdim=True)
    elif granularity == "blockwise":
        rows = BLOCK if weight else 1
        tiled = _tiles(t, rows, BLOCK).amax(dim=(1, 3), keepdim=True)
        amax = tiled.expand(-1, rows, -1, BLOCK).reshape(tiled.shape[0] * rows, -1)[: t.shape[0], : t.shape[1]]
    else:
        raise ValueError(f"numerics watch: unknown scaling granularity {granularity!r}; use one of {GRANULARITIES}.")
    scale = FP8_MAX[dtype] / amax
    return torch.where((amax > 0) & torch.isfinite(amax), scale, torch.ones_like(scale))


def resolve_scale(t: torch.Tensor, dtype: torch.dtype, given: Scale, weight: bool = False) -> torch.Tensor:
    """The scale the layer casts `t` with: a tensor `given` by the engine as is; a granularity
    word ("rowwise", "blockwise") from `t`'s current amax at that granularity; None per tensor."""
    if isinstance(given, torch.Tensor):
        return given.detach().float().to(t.device)
    return amax_scale(t, dtype, given or "tensor", weight)


def fake_quantize(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` through FP8 and back (saturating as the engines' casts do), in float32."""
    limit = FP8_MAX[dtype]
    return (t.float() * scale).clamp(-limit, limit).to(dtype).float() / scale


def operand_stats(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> Dict[str, float]:
    """amax of `t`; `flushed`: the fraction of its nonzero values whose FP8 code is zero once
    scaled; `saturated`: the fraction of all values beyond the format's largest once scaled."""
    t = t.float()
    scaled = t * scale
    limit = FP8_MAX[dtype]
    nonzero = t != 0
    codes = scaled.clamp(-limit, limit).to(dtype).float()
    n_nonzero = int(nonzero.sum())
    flushed = int((nonzero & (codes == 0)).sum()) / n_nonzero if n_nonzero else 0.0
    # beyond the largest value by more than float32 rounding: a scale made from this very amax
    # puts the amax at fp8_max give or take an ulp, which no cast would call saturation
    saturated = int((scaled.abs() > limit * (1 + 2.0**-16)).sum()) / max(t.numel(), 1)
    return {"amax": float(t.abs().amax()) if t.numel() else 0.0, "flushed": flushed, "saturated": saturated}


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """10 log10(|reference|^2 / |reference - approx|^2): inf where they agree exactly, -inf
    where the reference is zero and they do not."""
    signal = float(reference.double().pow(2).sum())
    noise = float((reference.double() - approx.double()).pow(2).sum())
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def sample_index(rows: int, wanted: int, device) -> torch.Tensor:
    """The indices of `wanted` rows spread evenly over `rows` (all of them where there are fewer):
    deterministic, so one run's checks compare like with like."""
    if rows <= wanted:
        return torch.arange(rows, device=device)
    return torch.linspace(0, rows - 1, wanted, device=device).round().long()
