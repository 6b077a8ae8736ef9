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
    if not delayed:  # the torch ops and the operator read no scaling state for a dynamic cast
        prev_scale = use_prev = None
    if torch.compiler.is_compiling():  # one node for dynamo to trace (the operator below says why)
        t_fp8, t_t, inv, amax = torch.ops.fp8plug.per_tensor_cast(t.detach(), dtype, prev_scale, use_prev, margin)
        return t_fp8, t_t if transposed else None, inv, amax
    shared = source is not None and not delayed
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
        t_fp8, t_t, inv, amax = _cast_with_torch_ops(t, dtype, prev_scale, use_prev, margin, transposed, known_amax)
    if shared:  # both layouts, for whichever reader needs the transposed one
        shared_input.remember_cast(source, dtype, (t_fp8, t_t, inv, amax))
    # the kernel writes both layouts; one nobody needs is not kept (it would be saved for backward)
    return t_fp8, t_t if transposed else None, inv, amax


def _cast_with_torch_ops(t, dtype, prev_scale, use_prev, margin, transposed, known_amax=None):
    """The cast in torch ops: dynamic where `prev_scale` is None, else delayed."""
    amax = amax_of(t) if known_amax is None else known_amax
    if prev_scale is None:
        scale = scale_from_amax(amax, FP8_MAX[dtype])
    else:
        scale = delayed_scale(prev_scale, use_prev, amax, FP8_MAX[dtype], margin)
    t_fp8 = quantize(t, scale, dtype)
    # Backward needs both operands with the token dimension (wgrad) or out_features (dgrad)
    # contiguous. Transposing right after the cast lets the compiler write both layouts from one
    # read of the high-precision tensor.
    return t_fp8, t_fp8.t().contiguous() if transposed else None, scale.reciprocal(), amax


# Compiled, the cast is one operator whose kernel is its torch ops (CompositeImplicitAutograd): dynamo
# records one node and works out its outputs' shapes from those ops without interpreting them, and
# AOT autograd traces the ops into the graph inductor receives, so the compiler fuses them with
# the ops around them as before (the same graph; q, k and v still share their input's cast). Dynamo
# interpreting the ops took seconds: benchmarks/training/compile_cost.py's tracing time for the
# default went from 5.1 to 3.7 s on a CPU, and on an H200 (the benchmark Llama) rowwise's tracing
# from 4.0 to 2.3 s (its tile casts: granular's `fp8plug::tile_cast`), the default's 4.8 to 4.5 s.
# Both layouts are outputs; one nobody reads is dropped from the graph.
torch.library.define("fp8plug::per_tensor_cast",
                     "(Tensor t, ScalarType dtype, Tensor? prev_scale, Tensor? use_prev, int margin) "
                     "-> (Tensor, Tensor, Tensor, Tensor)")


@torch.library.impl("fp8plug::per_tensor_cast", "CompositeImplicitAutograd")
def _per_tensor_cast(t, dtype, prev_scale, use_prev, margin):
    return _cast_with_torch_ops(t, dtype, prev_scale, use_prev, margin, True)
