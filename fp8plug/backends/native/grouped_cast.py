"""The grouped FP8 GEMM's casts of weights stored [E, K, N] (GPT-OSS's), fused by torch.compile on
a GPU, and the scale arithmetic of the experts' Triton casts.

Why: eagerly, each cast in backends/native/grouped.py (amax per row or per group and column, the
scale, the scaled tensor, the FP8 copy, the scale's reciprocal) is five to seven torch launches,
each reading or writing the whole tensor in float32. For a Mixtral-sized experts module that is
the 3-D weight (940M elements for gate_up) read and written several times a step in each
direction, which cost more than FP8's GEMMs saved (docs/moe.md: 0.1-0.4x bf16 eagerly). Here the
weight casts that read along a strided dimension (weights stored [E, K, N], GPT-OSS's) are each
one torch.compile'd function (fullgraph, static shapes): the compiler makes one kernel of the
reduction and the cast. Weights stored [E, N, K] and the token casts, which read through the
padded layout, take backends.native.transposed_cast's Triton kernels; the weight gradient's
operand scales come from `scale_of` and `reciprocal` below.

Bit for bit the casts of grouped.py, on every backend: the maximum, the clamp, the product and the
float8 conversion are exact operations; Triton's float32 division is not (inductor writes it as
an approximate division unless told otherwise), so the two divisions here (the scale 448 / amax
and its reciprocal) are made in float64 and rounded to float32, which gives the correctly rounded
float32 quotient (a quotient of two floats rounded twice through a format of more than twice the
precision is rounded once). tests/cpu/test_moe_casts.py checks the fused casts against grouped.py's.

When: on CUDA wherever the casts run outside a trace (`usable`): eagerly, and inside the grouped
operator a compiled model calls (grouped.py; backends/native/compiled_ops.py says why the
compiled experts are an operator); on a CPU (the emulation) the torch ops run, as they are the
reference. The weight casts are compiled once per shape (static); one function per role below,
so each keeps its own entries in dynamo's cache.

The forward's weight cast (rowwise along K) and the input gradient's (one scale an expert, written
[E, K, N]) are made when each is needed: making both from one read in the forward would keep an
FP8 copy of every expert weight alive from forward to backward (1.4 GB a Mixtral layer, 45 GB for
32 layers).
"""

from __future__ import annotations

import logging
from typing import Callable, Dict, Tuple

import torch
from torch._dynamo.exc import FailOnRecompileLimitHit

from fp8plug.backends.native import transposed_cast

logger = logging.getLogger("fp8plug")

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)
AMAX_FLOOR = 1e-12  # an all-zero row (padding) gets a finite scale
GROUP_ALIGNMENT = 16  # rows per token group (grouped.py's padded layout)


def reciprocal(t: torch.Tensor) -> torch.Tensor:
    """1 / t in float32, correctly rounded (as torch's eager reciprocal) whatever division the
    backend emits."""
    return (1.0 / t.double()).float()


def scale_of(amax: torch.Tensor) -> torch.Tensor:
    """E4M3_MAX / amax as eager torch computes a number over a tensor (Tensor.__rtruediv__: the
    tensor's reciprocal, then times the number), clamped as grouped.py does."""
    return reciprocal(amax.clamp(min=AMAX_FLOOR)) * E4M3_MAX


def _rowwise(t: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """grouped.rowwise's cast: e4m3 with one scale per row of the last dimension, the inverses."""
    amax = torch.linalg.vector_norm(t, ord=float("inf"), dim=-1, keepdim=True, dtype=torch.float32)
    scale = scale_of(amax)
    data = (t * scale).to(E4M3).contiguous()
    return data, reciprocal(scale).squeeze(-1).contiguous()


# One function per role: dynamo keeps a cache of compiled shapes per function (8 by default), and
# a step casts differently shaped or strided weights.
def _weight_forward(t):
    return _rowwise(t)


def expert_scaled(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[E, R, C] in e4m3 with one scale per expert (`scale` [E] float32), contiguous: the input
    gradient's weight (backends/native/grouped.py says why one an expert)."""
    return (t * scale.view(-1, 1, 1)).to(E4M3).contiguous()


def _weight_input_grad(t, scale):
    return expert_scaled(t, scale)


_COMPILED: Dict[Callable, Callable] = {}


def compiled(function: Callable) -> Callable:
    """`function` compiled (fullgraph), once per process; nothing is compiled before the first
    cast that needs it."""
    done = _COMPILED.get(function)
    if done is None:  # a weight's shape never changes: static
        done = _COMPILED[function] = torch.compile(function, fullgraph=True, dynamic=False)
    return done


# Each role keeps one compiled entry per weight shape and per dispatch-key set (a parameter cast
# eagerly and the same weight inside a compiled model's operator differ), so a process that trains
# several models (one pytest process, a sweep) can pass dynamo's default of 8 entries per function, which
# under fullgraph is an error (seen on an H200: the ninth tiny MoE of a pytest run failed). The casts
# get a limit of their own; past it they run as the torch ops they compile (the same bytes), with one
# warning.
RECOMPILE_LIMIT = 64
_OVER_LIMIT: set = set()


def _run(function: Callable, *args):
    """`function`'s compiled form on `args`; the function itself once its compiled entries are full."""
    try:
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            return compiled(function)(*args)
    except FailOnRecompileLimitHit:
        if function not in _OVER_LIMIT:
            _OVER_LIMIT.add(function)
            logger.warning("fp8plug: the fused expert cast %s has compiled %d shapes in this process; further "
                           "shapes run it as unfused torch ops (the same values, slower)", function.__name__,
                           RECOMPILE_LIMIT)
        return function(*args)


def usable(t: torch.Tensor) -> bool:
    """Whether the fused casts run for `t`, these and transposed_cast's: outside a trace (eagerly,
    and inside the grouped operator a compiled model calls), on CUDA, with Triton."""
    return not torch.compiler.is_compiling() and transposed_cast.usable(t)


def weight_forward(w_nk: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The forward's weight [E, N, K] cast rowwise along K: for weights stored [E, K, N] (a
    transposed view here); those stored [E, N, K] take transposed_cast's row kernel (grouped.py)."""
    return _run(_weight_forward, w_nk)


def weight_input_grad(w_kn: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The input gradient's weight [E, K, N], one scale an expert, written contiguous: weights
    stored that way (GPT-OSS's); those stored [E, N, K] take transposed_cast's kernel (grouped.py)."""
    return _run(_weight_input_grad, w_kn, scale)


__all__ = ["expert_scaled", "reciprocal", "scale_of", "usable", "weight_forward", "weight_input_grad"]
