"""How the native engine casts one GEMM operand to FP8: the scale (dynamic, or delayed scaling's),
the FP8 copy and its transpose, by the eager CUDA kernel (backends.native.fused_cast) or by torch ops
(which torch.compile fuses with the ops around them), and, eagerly, one cast for an input several
layers read (backends.native.shared_input).

A module of its own so that linear.py holds the layer and engine.py the engine; the rule itself
is written here once, for the input and weight casts of forward and grad_output's in backward.
"""

from __future__ import annotations

import torch

from fp8plug.backends.native import fused_cast, shared_input
from fp8plug.backends.native.scaling import FP8_MAX, amax_of, delayed_scale, quantize, scale_from_amax


def cast_operand(t, dtype, delayed, prev_scale, use_prev, margin, transposed=True, source=None):
    """(t in FP8, its transpose in FP8 and contiguous (None unless `transposed`), the inverse of
    the scale used (the factor back to real values, as the GEMM takes it), max |t|).

    Dynamic (`delayed` False): the scale is t's own amax's. Delayed: scaling.delayed_scale of
    `prev_scale`, `use_prev` (a bool tensor: the slot has had an update) and t's amax. A CUDA
    tensor in eager execution is cast by backends.native.fused_cast (one pass for a delayed slot, two
    for a dynamic one, in four or three launches); everything else with torch ops, which
    torch.compile fuses with the ops around them. `source`: the layer input t was reshaped
    from; eagerly, a dynamic cast of an input other layers read too is made once for all of them
    (backends.native.shared_input)."""
    shared = source is not None and not delayed and not torch.compiler.is_compiling()
    known_amax = None
    if shared:
        kept = shared_input.cast_of(source, dtype, transposed)
        if kept is not None:
            return kept
        known_amax = shared_input.known_amax(source)
    t = t.detach()
    if fused_cast.usable(t):
        if delayed:
            t_fp8, t_t, _, amax, inv = fused_cast.cast_transpose(t, prev_scale, use_prev, dtype, margin)
        else:
            t_fp8, t_t, _, amax, inv = fused_cast.cast_transpose_dynamic(t, dtype, known_amax)
    else:
        amax = amax_of(t) if known_amax is None else known_amax
        if delayed:
            scale = delayed_scale(prev_scale, use_prev, amax, FP8_MAX[dtype], margin)
        else:
            scale = scale_from_amax(amax, FP8_MAX[dtype])
        t_fp8 = quantize(t, scale, dtype)
        # Backward needs both operands with the token dimension (wgrad) or out_features (dgrad)
        # contiguous. Transposing right after the cast lets the compiler write both layouts from one
        # read of the high-precision tensor.
        t_t, inv = t_fp8.t().contiguous() if transposed else None, scale.reciprocal()
    if shared:  # both layouts, for whichever reader needs the transposed one
        shared_input.remember_cast(source, dtype, (t_fp8, t_t, inv, amax))
    # the kernel writes both layouts; one nobody needs is not kept (it would be saved for backward)
    return t_fp8, t_t if transposed else None, inv, amax
